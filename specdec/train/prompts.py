"""Training prompts for `specdec distill`, built offline and disjoint from the bench suite.

Nothing may be downloaded, so the prompts are composed from templates and from text that
ships with Python itself: prose from the bundled documentation (`pydoc_data`) for
summaries and passage questions, source code of the standard library for code edits.
Passages to summarize or answer questions about also come from the target itself: it
first writes short reports and stories (`passage_requests`), so that the draft also sees
the target summarizing everyday prose, not only technical documentation.
The mix mirrors the bench's task categories, but no bench prompt is reused (the bench
measures a draft on prompts it never trained on; `distill` checks this).
"""
from __future__ import annotations

import ast
import functools
import random
import re
import sysconfig
from pathlib import Path

TOPICS = """photosynthesis; volcanoes; the water cycle; black holes; vaccines; the printing press;
plate tectonics; the Roman Empire; compound interest; rainbows; earthquakes; bees and pollination;
the human heart; electric cars; solar panels; the stock market; inflation; coral reefs; the moon's
phases; glaciers; the Silk Road; the French Revolution; DNA; antibiotics; the immune system;
machine learning; the internet; encryption; recycling; composting; sleep; caffeine; tides;
hurricanes; deserts; rainforests; the Great Wall of China; the steam engine; electricity; magnets;
gravity; the speed of light; atoms; chemical reactions; friction; sound waves; the seasons;
migratory birds; octopuses; dinosaurs; fossils; the Renaissance; democracy; taxes; supply and
demand; budgeting; public libraries; chess; jazz music; the Olympic Games; coffee; bread baking;
fermentation; soil erosion; wind turbines; nuclear power; batteries; smartphones; GPS; airplanes;
submarines; bridges; skyscrapers; the periodic table; volcanic islands; penguins; wolves; whales;
ants; mushrooms; trees in autumn; the Amazon river; mountains; clouds; lightning; snowflakes;
the Mars rovers; telescopes; satellites; time zones; calendars; the metric system; prime numbers;
fractions; probability; statistics; public speaking; job interviews; learning a language;
meditation; healthy eating; running; swimming; gardening; houseplants; pet dogs; cats; first aid;
saving money; renting an apartment; cooking rice; making tea; writing a resume; email etiquette;
team meetings; remote work; open source software; databases; version control; unit testing;
spreadsheets; cloud computing; operating systems; compilers; sorting algorithms; binary numbers"""

QUESTION_TEMPLATES = [
    "What is {t}? Explain it simply.", "How does {t} work?", "Why is {t} important?",
    "Give three interesting facts about {t}.", "Explain {t} to a ten-year-old.",
    "What are the main advantages and disadvantages of {t}?", "Write a short paragraph about {t}.",
    "What is a common misconception about {t}?", "Describe the history of {t} in a few sentences.",
    "List five key terms related to {t} and define each one.", "How has {t} changed over the last hundred years?",
    "What would happen if there were no {t}?", "Summarize what scientists know about {t}.",
]
ADVICE = [
    "I have trouble focusing when I study at home. What can I do?", "How can I get better at {t}?",
    "I want to learn about {t}. Where should I start?", "My friend is nervous about {t}. How can I help?",
    "Can you suggest a weekend plan that involves {t}?", "I keep forgetting to drink water. Any tips?",
    "How do I stay motivated when learning something new like {t}?",
    "What questions should I ask an expert on {t}?",
]
REQUESTS = [
    "Tell me a short story about {who} who {goal}.", "Can you suggest a name for {business}?",
    "Help me plan {event}.", "I am going on {trip}. What should I pack?",
    "What is a thoughtful gift for {person} who likes {t}?", "What are some good habits for {area}?",
    "Write a short poem about {t}.", "Give me a simple recipe for {dish}.",
    "Write a polite email to {person} about {matter}.", "I have {time} free this afternoon. What could I do?",
    "What should I practice in my first month of {skill}?", "How should I structure a short talk about {t}?",
]
SLOTS = dict(
    who=["a cat", "an old lighthouse keeper", "a young inventor", "a lost robot", "a shy dragon", "two friends",
         "a baker", "a little fox", "a retired pilot", "a girl with a red kite"],
    goal=["wants to see the sea", "finds a secret door", "learns to sing", "builds a boat", "makes a new friend",
          "loses a key", "wins a race", "plants a garden", "travels to the city", "fixes an old clock"],
    business=["a coffee shop near a university", "a dog grooming service", "a bike repair shop",
              "a small bookstore", "a flower stall", "a tutoring company", "a food truck that sells tacos"],
    event=["a birthday party for a six-year-old", "a family picnic", "a study schedule for my exams",
           "a day in a new city", "a team lunch for ten people", "a movie night with friends",
           "a week of healthy breakfasts", "a garage sale"],
    trip=["a beach holiday", "a business trip", "a camping weekend", "a week in a cold city",
          "a long train journey", "a hiking trip in the desert"],
    person=["my neighbor", "my manager", "a coworker", "my grandmother", "my landlord", "a teacher",
            "my best friend", "a customer"],
    area=["working from home", "saving money", "sleeping well", "studying for exams", "staying organized",
          "eating healthy", "keeping a clean kitchen"],
    dish=["vegetable soup", "pancakes", "a tomato pasta", "fried rice", "a fruit salad", "banana bread", "an omelette"],
    matter=["a late payment", "a meeting next week", "a noisy party", "a broken heater", "a project deadline",
            "a thank-you for their help"],
    time=["two hours", "one hour", "three hours"],
    skill=["learning the piano", "drawing", "learning to code", "running", "photography", "yoga", "chess"],
)
PEOPLE = ["Isaac Newton", "Ada Lovelace", "Leonardo da Vinci", "Charles Darwin", "Albert Einstein",
          "Florence Nightingale", "Nikola Tesla", "Galileo Galilei", "Jane Austen", "William Shakespeare",
          "Louis Pasteur", "Alan Turing", "Wolfgang Amadeus Mozart", "Julius Caesar", "Cleopatra",
          "Christopher Columbus", "Thomas Edison", "Rosalind Franklin", "Johannes Gutenberg", "Frida Kahlo"]
COUNTRIES = ["Canada", "Japan", "Brazil", "Kenya", "Norway", "Egypt", "Mexico", "India", "Spain", "Chile",
             "Thailand", "Poland", "Peru", "Ghana", "Vietnam", "New Zealand"]
PAIRS = [("weather", "climate"), ("a virus", "a bacterium"), ("speed", "velocity"), ("a lake", "a sea"),
         ("an asteroid", "a comet"), ("mass", "weight"), ("a democracy", "a monarchy"), ("RAM", "storage"),
         ("a frog", "a toad"), ("a hurricane", "a tornado"), ("saving", "investing"), ("a star", "a planet")]
WHY = ["Why do leaves change color in autumn?", "Why is the ocean salty?", "Why do cats purr?",
       "Why do we get hiccups?", "Why does ice float on water?", "Why do stars twinkle?",
       "Why do onions make people cry?", "Why is the sunset red?", "Why do birds fly south for the winter?",
       "Why does bread rise?", "Why do we dream?", "Why do metals feel cold to the touch?"]
FOREIGN = {  # (subjects, actions, times) in each language, composed like the English SUBJECTS, ACTIONS, TIMES
    "French": (["Ma sœur", "Le professeur", "Notre voisin", "Le petit chien", "Mon grand-père", "Le chef"],
               ["lit un livre", "va au marché", "prépare le dîner", "joue du piano", "écrit une lettre",
                "boit un café"],
               ["chaque matin", "le dimanche", "après le travail", "le soir", "en été", "avec ses amis"]),
    "Spanish": (["Mi hermana", "El profesor", "Nuestro vecino", "El perro pequeño", "Mi abuelo", "El cocinero"],
                ["lee un libro", "va al mercado", "prepara la cena", "toca el piano", "escribe una carta",
                 "bebe un café"],
                ["cada mañana", "los domingos", "después del trabajo", "por la noche", "en verano",
                 "con sus amigos"]),
    "German": (["Meine Schwester", "Der Lehrer", "Unser Nachbar", "Der kleine Hund", "Mein Großvater", "Der Koch"],
               ["liest ein Buch", "geht zum Markt", "kocht das Abendessen", "spielt Klavier", "schreibt einen Brief",
                "trinkt einen Kaffee"],
               ["jeden Morgen", "am Sonntag", "nach der Arbeit", "am Abend", "im Sommer", "mit seinen Freunden"]),
}
PASSAGE_REQUESTS = [
    "Write a short news report about {t} in the town of {town}.",
    "Write a paragraph describing a study by researchers in {town} about {t}.",
    "Write a short article about how a small {shop} in {town} changed the way it works.",
    "Write a short story about {who} who {goal}.",
    "Describe a community project about {t} in the village of {town}.",
]
TOWNS = ["Maplewood", "Stonebridge", "Clearwater", "Ashford", "Little Hollow", "Port Ellery", "Greenfield",
         "Redcliff", "Westbury", "Fairhaven", "Oakdale", "Silverlake"]
SHOPS = ["bakery", "bookstore", "bike shop", "cafe", "pharmacy", "garden center", "hardware store", "clinic"]
MATH = [
    "Solve step by step: {who} has {a} {item} and buys {b} more, then gives away {c}. How many are left?",
    "Solve step by step: {who} packs {ac} {item} into boxes of {c}. How many boxes are needed?",
    "What is {a} times {b} plus {c}? Show your work.",
    "Solve step by step: A train travels {a} km per hour for {c} hours. How far does it go?",
    "Solve for x: {c}x + {a} = {a_cb}. Explain each step.",
    "{who} saves {b} dollars a week. How many weeks until {who} has {ab} dollars?",
    "Solve step by step: A rectangle is {a} cm long and {b} cm wide. What are its area and perimeter?",
    "Solve step by step: A jacket costs ${a}0 and is {pct}% off. What is the sale price?",
    "Solve step by step: {who} scored {a}, {b}, and {c} points in three games. What is the average?",
    "Solve step by step: {c} friends share {ac} {item} equally. How many does each friend get?",
    "Solve step by step: A recipe uses {c} eggs for {b} pancakes. How many eggs are needed for {bc2} pancakes?",
    "Solve step by step: {who} is {c} years old. A cousin is {b} years older. How old will the cousin be in {a} years?",
    "Solve step by step: A tank holds {ab} liters and fills at {b} liters per minute. How long does it take to fill?",
    "Solve step by step: {who} buys {c} notebooks at ${b} each and pays with ${hund}. How much change is left?",
]
FOLLOW_UPS = ["Can you give an example?", "Can you make that shorter?", "Why is that?",
              "What should I do first?", "Can you explain that in simpler words?", "Can you give me two more ideas?",
              "Which of those would you pick, and why?", "Thanks! Can you turn that into a short list?",
              "What if I only have a small budget?", "Can you make it funnier?"]
LANGUAGES = ["French", "Spanish", "German", "Italian", "Portuguese"]
SUBJECTS = ["My sister", "The teacher", "Our neighbor", "The small dog", "A young doctor", "The old farmer",
            "Every student", "The chef", "My grandfather", "The team"]
ACTIONS = ["reads a book", "walks to the market", "cooks dinner", "plays the piano", "writes a letter",
           "visits the museum", "drinks coffee", "waits for the train", "plants flowers", "watches the rain"]
TIMES = ["every morning", "on Sundays", "after work", "before breakfast", "in the summer", "at night",
         "with friends", "near the river", "when it is cold", "at the weekend"]
FUNCTIONS = [
    ("count_vowels(text)", "returns how many vowels are in a string"),
    ("flatten(nested)", "flattens a list of lists into one list"),
    ("fibonacci(n)", "returns the first n Fibonacci numbers"),
    ("merge_dicts(a, b)", "merges two dictionaries, summing values of shared keys"),
    ("chunk(items, size)", "splits a list into chunks of a given size"),
    ("is_prime(n)", "checks whether a number is prime"),
    ("word_frequencies(text)", "returns a dictionary of word counts"),
    ("reverse_words(sentence)", "reverses the order of words in a sentence"),
    ("celsius_to_fahrenheit(c)", "converts a temperature"),
    ("unique_sorted(values)", "returns the sorted unique values of a list"),
    ("gcd(a, b)", "computes the greatest common divisor"),
    ("read_csv_rows(path)", "reads a CSV file and returns its rows as dictionaries"),
    ("binary_search(items, target)", "finds the index of target in a sorted list"),
    ("moving_average(values, window)", "returns the moving averages of a list"),
    ("capitalize_words(text)", "capitalizes the first letter of each word"),
    ("second_largest(numbers)", "returns the second largest number in a list"),
    ("rotate_list(items, k)", "rotates a list to the right by k positions"),
    ("count_lines(path)", "counts the lines in a text file"),
    ("to_snake_case(name)", "converts a CamelCase name to snake_case"),
    ("validate_email(address)", "checks whether a string looks like an email address"),
    ("matrix_transpose(rows)", "transposes a matrix given as a list of lists"),
    ("run_length_encode(text)", "compresses a string with run-length encoding"),
    ("average_grade(grades)", "returns the average of a list of grades, or None if empty"),
    ("dedupe_keep_order(items)", "removes duplicates while keeping the original order"),
    ("is_anagram(a, b)", "checks whether two words are anagrams of each other"),
    ("factorial(n)", "returns n factorial, computed iteratively"),
    ("sum_of_digits(n)", "returns the sum of the digits of a non-negative integer"),
    ("longest_word(sentence)", "returns the longest word in a sentence"),
    ("remove_punctuation(text)", "removes all punctuation characters from a string"),
    ("count_words(text)", "returns the number of words in a string"),
    ("max_profit(prices)", "returns the best profit from buying and then selling once, given daily prices"),
    ("pairs_with_sum(numbers, target)", "returns all pairs of numbers that add up to target"),
    ("title_case(text)", "converts a sentence to title case, keeping small words like 'and' lowercase"),
    ("median(values)", "returns the median of a list of numbers"),
    ("common_elements(a, b)", "returns the elements two lists have in common, without duplicates"),
    ("caesar_cipher(text, shift)", "shifts every letter of a string by a given number of places"),
    ("is_balanced(brackets)", "checks whether the brackets in a string are balanced"),
    ("digits_to_words(n)", "spells out each digit of a number as a word"),
    ("group_by_length(words)", "groups words into a dictionary keyed by their length"),
    ("running_total(values)", "returns the running totals of a list of numbers"),
    ("count_uppercase(text)", "counts the uppercase letters in a string"),
    ("leap_year(year)", "returns True if a year is a leap year"),
    ("min_max(values)", "returns the smallest and largest values of a list as a tuple, or None if empty"),
    ("parse_key_values(text)", "parses lines like 'key=value' into a dictionary"),
]
CODE_LANGS = ["Python", "Python", "Python", "JavaScript"]
EDITS = [
    "Add type hints to this code.", "Add a docstring to every function.",
    "Rename the variables to more descriptive names.", "Add error handling for invalid input.",
    "Explain what this code does, line by line.", "Rewrite this code to be more readable.",
    "Find a possible bug in this code and fix it.", "Add comments explaining the tricky parts.",
    "Write unit tests for this code.", "Convert this code to use f-strings where it formats text.",
    "Simplify this function without changing what it does.", "Add input validation and raise ValueError on bad input.",
    "Rewrite this function to avoid the nested loops if possible.", "Make this code follow PEP 8.",
    "Add logging to this code.", "Explain what could go wrong with this code and how to fix it.",
]
PASSAGE_TASKS = [
    "Summarize the following text in two sentences.", "Summarize the main points of this text as a bullet list.",
    "Write a one-sentence summary of this text.", "Explain this text in plain language.",
    "Give a brief summary of the text below.", "Summarize this text for a busy reader in three sentences.",
    "What are the key points of the following text? Summarize them briefly.",
]
RAG_QUESTIONS = [
    "What is the main idea of the passage?", "According to the passage, what does {w} refer to?",
    "What does the passage say about {w}?", "Which example does the passage give?",
    "List the key facts stated in the passage.", "Who or what is the passage mainly about?",
    "What happened according to the passage, and why?", "What numbers or dates does the passage mention?",
]
RAG_INSTRUCTIONS = ["Read the passage and answer the question using only the passage.",
                    "Answer the question using only information from the passage below.",
                    "Use the passage to answer the question. Quote it where you can."]

# The "spec-bench" mix (`specdec distill --mix spec-bench`) adds what Spec-Bench's categories
# ask and the first mix lacks: long news-style articles to summarize and long passages to
# answer from (the target's own reports, several joined), short factual questions, German
# news-style paragraphs to translate into English, role-play, open writing, reasoning
# puzzles and extraction. Every template here was written for this project; none is a
# Spec-Bench item (the bench's own prompts are excluded by text as well).
ROLES = ["a ship's captain", "a medieval innkeeper", "a detective in 1920s London", "a friendly tour guide in Rome",
         "a strict but kind chess coach", "a pirate looking for treasure", "a travel agent", "a museum curator",
         "a wise old wizard", "a customer service agent for an airline", "a chef running a busy kitchen",
         "a park ranger", "a radio host taking calls", "a job interviewer at a tech company", "a fitness coach",
         "an astronaut on the space station", "a librarian in a small town", "a knight guarding a bridge"]
SCENES = ["A traveler asks you for directions and a place to sleep.", "I am a new visitor. Introduce yourself.",
          "I want to complain about something that went wrong today.", "Tell me about your most difficult day.",
          "A child asks you what your job is like.", "I ask you for advice on a big decision.",
          "You have just received surprising news. React to it.", "Convince me to join your team.",
          "Describe what you see around you right now.", "I am late and in a hurry. Help me quickly."]
FORMS = ["a blog post", "a short essay", "a persuasive letter", "a short speech", "a product description",
         "a diary entry", "a short story", "a poem with four stanzas", "an opening paragraph for a novel",
         "a cover letter", "a review", "a motivational message", "a newspaper opinion piece"]
AUDIENCES = ["for teenagers", "for a general audience", "for busy parents", "for beginners", "for a school newsletter",
             "for a company website", "for my grandparents", ""]
ELEMENTS = ["oxygen", "gold", "iron", "carbon", "helium", "sodium", "silver", "copper", "hydrogen", "calcium"]
ANIMALS = ["a spider", "an octopus", "a giraffe", "a bee", "a penguin", "a blue whale", "an elephant", "a bat",
           "a shark", "a camel"]
SHORT_QA = ["What is the chemical symbol for {element}?", "How many legs does {animal} have?",
            "What language is mainly spoken in {country}?", "What continent is {country} in?",
            "What is the currency of {country}?", "When did {person} live?", "Where was {person} born?",
            "What is {person} best known for? Answer in one sentence.", "Where does {animal} live?",
            "What does {animal} eat?", "Is {element} a metal?", "How many minutes are in {n} hours?",
            "How many days are in {n} weeks?", "What is the boiling point of water in Fahrenheit?",
            "Which planet is closest to the sun?", "What is the largest ocean on Earth?",
            "Who painted the Mona Lisa?", "What gas do plants take in from the air?"]
GERMAN_NEWS = (
    ["Die Stadt {town}", "Der Bürgermeister von {town}", "Eine Gruppe von Forschern", "Die Regierung",
     "Ein kleines Unternehmen aus {town}", "Die Schule in {town}", "Der Fußballverein", "Die Polizei"],
    ["plant ein neues Projekt", "hat am Montag eine neue Studie vorgestellt", "will mehr Geld in Bildung investieren",
     "eröffnet nächste Woche eine Bibliothek", "sucht neue Mitarbeiter", "hat den Preis gewonnen",
     "warnt vor starkem Regen", "baut einen neuen Bahnhof", "feiert sein hundertjähriges Jubiläum",
     "diskutiert über höhere Mieten"],
    ["für die Bürger", "im nächsten Jahr", "trotz vieler Kritik", "nach langen Verhandlungen", "am Wochenende",
     "mit großer Unterstützung", "in der Innenstadt", "seit dem Frühjahr"],
)
PUZZLES = [
    "{a} is taller than {b}, and {b} is taller than {c}. Who is the shortest? Explain your reasoning.",
    "If all {x} are {y} and some {y} are {z}, must some {x} be {z}? Explain.",
    "{a} finished the race before {b} but after {c}. Who came first?",
    "I have {n} coins that add up to {m} cents, and none are pennies. What could they be? Think step by step.",
    "A farmer has chickens and cows, {n} heads and {m2} legs in all. How many of each are there?",
    "{a} says {b} is lying. {b} says {c} is lying. {c} says both are lying. Who tells the truth?",
    "What comes next in the sequence {s}? Explain the pattern.",
]
NAMES = ["Anna", "Ben", "Chloe", "David", "Elif", "Farid", "Grace", "Hugo", "Ines", "Jamal", "Kira", "Leo"]
EXTRACT = ["Extract every name of a person or place from the text below as a list.",
           "List all numbers and dates that appear in the text below, with what each refers to.",
           "Extract the main events from the text below as a numbered list.",
           "From the text below, extract who did what, as short 'who: what' lines.",
           "Return a JSON object with the keys \"topic\", \"place\" and \"people\" for the text below."]


def _topics() -> list[str]:
    return [t.strip() for t in TOPICS.replace("\n", " ").split(";") if t.strip()]


def _passages(rng: random.Random, n: int) -> list[str]:
    """Prose paragraphs from Python's bundled documentation (no code listings, no tables)."""
    from pydoc_data.topics import topics

    paras = []
    for text in topics.values():
        for para in re.split(r"\n\s*\n", text):
            para = " ".join(para.split())
            if 250 <= len(para) <= 900 and para.count(".") >= 2 and not re.search(r"[{}|=>]{2}|\*\*\*|>>>", para):
                paras.append(para)
    paras.sort()
    return rng.sample(paras, min(n, len(paras)))


def _code_snippets(rng: random.Random, n: int) -> list[str]:
    """Small top-level functions from the standard library's own source files."""
    snippets = _stdlib_functions()
    return rng.sample(snippets, min(n, len(snippets)))


@functools.cache
def _stdlib_functions() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if not p.name.startswith("_"))
    snippets = []
    for path in files:
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
        lines = re.findall(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+\Z", source)  # as ast splits them
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                code = _segment(lines, node)
                if 150 <= len(code) <= 800:
                    snippets.append(code)
    return snippets


def _segment(lines: list[str], node: ast.AST) -> str:
    """ast.get_source_segment(source, node) from the source's lines, split once: it splits the
    whole file again at each call."""
    first, last = node.lineno - 1, node.end_lineno - 1  # offsets are in UTF-8 bytes
    if first == last:
        return lines[first].encode()[node.col_offset:node.end_col_offset].decode()
    return (lines[first].encode()[node.col_offset:].decode() + "".join(lines[first + 1:last])
            + lines[last].encode()[:node.end_col_offset].decode())


def passage_requests(n: int, seed: int = 0) -> list[str]:
    """`n` prompts asking the target for a short report or story: the passages it writes
    are then summarized and questioned in `training_conversations(..., written=...)`."""
    rng = random.Random(seed + 1)
    topics = _topics()
    out: list[str] = []
    for _ in range(50 * n):  # distinct requests, as long as the templates allow
        if len(out) == n:
            break
        r = rng.choice(PASSAGE_REQUESTS).format(t=rng.choice(topics), town=rng.choice(TOWNS), shop=rng.choice(SHOPS),
                                                who=rng.choice(SLOTS["who"]), goal=rng.choice(SLOTS["goal"]))
        if r not in out:
            out.append(r)
    return out


MIXES = ("v1", "spec-bench", "self")

# mix "self": half the prompts are user turns the target writes itself (Magpie, Xu et al.
# 2024): given its chat template up to a user turn's text and one of these openers, it
# samples what a user would ask. Templates repeat their own few phrasings; a draft trained
# on the target's answers to them agrees with it far more on their kind than on prompts
# written apart from them (0.52 against 0.36 greedy agreement). At the shipped draft's budget
# its own turns do not close that gap (`git show 3681d61:docs/benchmark.md`); the mix stays an option. The
# openers only steer the kind of request; the empty one leaves it to the target.
OPENERS = ["", "", "", "Write", "Explain", "How", "What", "Can you", "Translate", "Summarize", "Give me", "I",
           "You are", "Solve", "Why", "Describe", "Tell me", "List", "Compare", "Help me", "Please", "Create",
           "Imagine", "Is it", "Which", "My"]


def openers(n: int, seed: int = 0) -> list[str]:
    """`n` openers for the target's own user turns, deterministic for a seed."""
    rng = random.Random(seed + 2)
    return [rng.choice(OPENERS) for _ in range(n)]


def training_conversations(n: int, seed: int = 0, exclude: set[str] = frozenset(),
                           written: list[str] = (), mix: str = "v1") -> list[list[str]]:
    """`n` user turns lists (one or two turns each), deterministic for a seed (and `written`,
    the target's own passages, which join the documentation prose as text to summarize).
    mix "v1": the shipped draft's prompts; "spec-bench": also the kinds Spec-Bench's
    categories ask for (see ROLES above), the v1 kinds at a lower weight; "self": as
    spec-bench (the templated half of that mix; `distill` adds the target's own turns)."""
    if mix not in MIXES:
        raise ValueError(f"mix must be one of {MIXES}, got {mix!r}")
    rng = random.Random(seed)
    topics = _topics()
    passages = _passages(rng, n) + list(written)
    rng.shuffle(passages)
    code = _code_snippets(rng, n)

    def fill(template):
        return template.format(t=rng.choice(topics), **{k: rng.choice(v) for k, v in SLOTS.items()})

    def question():
        return rng.choice(QUESTION_TEMPLATES).format(t=rng.choice(topics))

    def fact():
        a, b = rng.choice(PAIRS)
        return rng.choice([f"Who was {rng.choice(PEOPLE)} and what are they known for?",
                           f"What is the capital city of {rng.choice(COUNTRIES)}?",
                           f"What is the difference between {a} and {b}?", rng.choice(WHY)])

    def math():
        a, b, c = rng.randint(3, 60), rng.randint(2, 40), rng.randint(2, 9)
        item = rng.choice(["apples", "books", "tickets", "cookies", "marbles", "stamps", "pencils"])
        who = rng.choice(["Maria", "Tom", "A shop", "The class", "Ahmed", "Lena", "Priya", "Jonas", "Mei"])
        return rng.choice(MATH).format(who=who, item=item, a=a, b=b, c=c, ac=a * c, a_cb=a + c * b, ab=a * b,
                                       pct=rng.choice([10, 20, 25, 30, 50]), bc2=b * 2, hund=rng.choice([50, 100]))

    def translation():
        if rng.random() < 0.5:
            lang, (subj, act, when) = rng.choice(sorted(FOREIGN.items()))
            return (f"Translate the following {lang} text into English:\n\n"
                    f"{rng.choice(subj)} {rng.choice(act)} {rng.choice(when)}.")
        s = f"{rng.choice(SUBJECTS)} {rng.choice(ACTIONS)} {rng.choice(TIMES)}."
        if rng.random() < 0.5:
            s += f" {rng.choice(SUBJECTS)} {rng.choice(ACTIONS)} {rng.choice(TIMES)}."
        return f"Translate the following {rng.choice(['sentence', 'text'])} into {rng.choice(LANGUAGES)}:\n\n{s}"

    def codegen():
        sig, what = rng.choice(FUNCTIONS)
        return f"Write a {rng.choice(CODE_LANGS)} function `{sig}` that {what}."

    def code_edit():
        intro = rng.choice(["Here is some Python code:", "Here is a Python snippet:", "Look at this function:"])
        return f"{intro}\n\n```python\n{code.pop()}\n```\n\n{rng.choice(EDITS)}"

    def summary():
        return f"{rng.choice(PASSAGE_TASKS)}\n\n{passages.pop()}"

    def rag():
        passage = passages.pop()
        words = [w for w in re.findall(r"[a-z]{6,}", passage)] or ["it"]
        q = rng.choice(RAG_QUESTIONS).format(w=rng.choice(words))
        return f"{rng.choice(RAG_INSTRUCTIONS)}\n\nPassage:\n{passage}\n\nQuestion: {q}"

    def chat():
        turns = [fill(rng.choice(ADVICE + REQUESTS))]
        if rng.random() < 0.5:
            turns.append(rng.choice(FOLLOW_UPS))
        return turns

    own = list(written)  # the target's own reports: several joined make a long article

    def article(k):
        return "\n\n".join(rng.sample(own, k)) if len(own) >= k else passages.pop()

    def news_summary():
        return f"{rng.choice(PASSAGE_TASKS)}\n\n{article(rng.choice([2, 3, 4]))}"

    def long_rag():
        text = article(rng.choice([2, 3, 4]))
        words = re.findall(r"[a-z]{6,}", text) or ["it"]
        q = rng.choice(RAG_QUESTIONS).format(w=rng.choice(words))
        return f"{rng.choice(RAG_INSTRUCTIONS)}\n\nPassage:\n{text}\n\nQuestion: {q}"

    def short_qa():
        return rng.choice(SHORT_QA).format(element=rng.choice(ELEMENTS), animal=rng.choice(ANIMALS),
                                           country=rng.choice(COUNTRIES), person=rng.choice(PEOPLE),
                                           n=rng.randint(2, 12))

    def german_news():
        subj, act, when = GERMAN_NEWS
        sentences = [f"{rng.choice(subj)} {rng.choice(act)} {rng.choice(when)}.".format(town=rng.choice(TOWNS))
                     for _ in range(rng.randint(2, 5))]
        return f"Translate the following German text into English:\n\n{' '.join(sentences)}"

    def roleplay():
        turns = [f"You are {rng.choice(ROLES)}. Stay in character. {rng.choice(SCENES)}"]
        if rng.random() < 0.3:
            turns.append(rng.choice(FOLLOW_UPS))
        return turns

    def writing():
        return f"Write {rng.choice(FORMS)} about {rng.choice(topics)} {rng.choice(AUDIENCES)}".strip() + "."

    def reasoning():
        a, b, c = rng.sample(NAMES, 3)
        x, y, z = rng.sample(["cats", "pets", "animals", "birds", "dogs", "plants", "tools", "cars"], 3)
        n = rng.randint(3, 30)
        start, step = rng.randint(1, 9), rng.randint(2, 7)
        return rng.choice(PUZZLES).format(a=a, b=b, c=c, x=x, y=y, z=z, n=n, m=5 * n + 5 * rng.randint(0, n),
                                          m2=2 * n + 2 * rng.randint(0, n),
                                          s=", ".join(str(start + step * i) for i in range(5)))

    def extraction():
        return f"{rng.choice(EXTRACT)}\n\n{article(1)}"

    makers = [(question, 3), (fact, 1), (math, 3), (translation, 2), (codegen, 2), (code_edit, 3), (summary, 2),
              (rag, 2), (chat, 3)]
    if mix != "v1":  # about one in three prompts of the old kinds, the rest Spec-Bench's
        makers = [(question, 2), (fact, 1), (math, 3), (translation, 1), (codegen, 2), (code_edit, 1), (summary, 1),
                  (rag, 1), (chat, 2), (news_summary, 3), (long_rag, 3), (short_qa, 3), (german_news, 3),
                  (roleplay, 3), (writing, 3), (reasoning, 3), (extraction, 3)]
    kinds = [m for m, w in makers for _ in range(w)]
    out, seen = [], set(exclude)
    while len(out) < n:
        if not passages or not code:
            raise ValueError(f"the prompt sources run out before {n} prompts")
        turns = rng.choice(kinds)()
        turns = turns if isinstance(turns, list) else [turns]
        if turns[0] in seen:
            continue
        seen.add(turns[0])
        out.append(turns)
    return out
