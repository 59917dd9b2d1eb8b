"""Training prompts for `specdec distill`, built offline and disjoint from the bench suite.

Nothing may be downloaded, so the prompts are composed from templates and from text that
ships with Python itself: prose from the bundled documentation (`pydoc_data`) for
summaries and passage questions, source code of the standard library for code edits.
The mix mirrors the bench's task categories, but no bench prompt is reused (the bench
measures a draft on prompts it never trained on; `distill` checks this).
"""
from __future__ import annotations

import ast
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
    "List five key terms related to {t} and define each one.",
]
ADVICE = [
    "I have trouble focusing when I study at home. What can I do?", "How can I get better at {t}?",
    "I want to learn about {t}. Where should I start?", "My friend is nervous about {t}. How can I help?",
    "Can you suggest a weekend plan that involves {t}?", "I keep forgetting to drink water. Any tips?",
    "How do I stay motivated when learning something new like {t}?",
    "What questions should I ask an expert on {t}?",
]
FOLLOW_UPS = ["Can you give an example?", "Can you make that shorter?", "Why is that?",
              "What should I do first?", "Can you explain that in simpler words?"]
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
]
CODE_LANGS = ["Python", "Python", "Python", "JavaScript"]
EDITS = [
    "Add type hints to this code.", "Add a docstring to every function.",
    "Rename the variables to more descriptive names.", "Add error handling for invalid input.",
    "Explain what this code does, line by line.", "Rewrite this code to be more readable.",
    "Find a possible bug in this code and fix it.", "Add comments explaining the tricky parts.",
    "Write unit tests for this code.", "Convert this code to use f-strings where it formats text.",
]
PASSAGE_TASKS = [
    "Summarize the following text in two sentences.", "Summarize the main points of this text as a bullet list.",
    "Write a one-sentence summary of this text.", "Explain this text in plain language.",
]
RAG_QUESTIONS = [
    "What is the main idea of the passage?", "According to the passage, what does {w} refer to?",
    "What does the passage say about {w}?", "Which example does the passage give?",
    "List the key facts stated in the passage.",
]


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
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if not p.name.startswith("_"))
    snippets = []
    for path in files:
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (OSError, SyntaxError, UnicodeDecodeError):
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef):
                code = ast.get_source_segment(source, node) or ""
                if 150 <= len(code) <= 800:
                    snippets.append(code)
    return rng.sample(snippets, min(n, len(snippets)))


def training_conversations(n: int, seed: int = 0, exclude: set[str] = frozenset()) -> list[list[str]]:
    """`n` user turns lists (one or two turns each), deterministic for a seed."""
    rng = random.Random(seed)
    topics = _topics()
    passages = _passages(rng, n)
    code = _code_snippets(rng, n)

    def question():
        return rng.choice(QUESTION_TEMPLATES).format(t=rng.choice(topics))

    def math():
        a, b, c = rng.randint(3, 60), rng.randint(2, 40), rng.randint(2, 9)
        item = rng.choice(["apples", "books", "tickets", "cookies", "marbles", "stamps", "pencils"])
        who = rng.choice(["Maria", "Tom", "A shop", "The class", "Ahmed", "Lena"])
        return rng.choice([
            f"Solve step by step: {who} has {a} {item} and buys {b} more, then gives away {c}. How many are left?",
            f"Solve step by step: {who} packs {a * c} {item} into boxes of {c}. How many boxes are needed?",
            f"What is {a} times {b} plus {c}? Show your work.",
            f"Solve step by step: A train travels {a} km per hour for {c} hours. How far does it go?",
            f"Solve for x: {c}x + {a} = {a + c * b}. Explain each step.",
            f"{who} saves {b} dollars a week. How many weeks until {who} has {b * a} dollars?",
        ])

    def translation():
        s = f"{rng.choice(SUBJECTS)} {rng.choice(ACTIONS)} {rng.choice(TIMES)}."
        return f"Translate the following sentence into {rng.choice(LANGUAGES)}:\n\n{s}"

    def codegen():
        sig, what = rng.choice(FUNCTIONS)
        return f"Write a {rng.choice(CODE_LANGS)} function `{sig}` that {what}."

    def code_edit():
        return f"Here is some Python code:\n\n```python\n{code.pop()}\n```\n\n{rng.choice(EDITS)}"

    def summary():
        return f"{rng.choice(PASSAGE_TASKS)}\n\n{passages.pop()}"

    def rag():
        passage = passages.pop()
        words = [w for w in re.findall(r"[a-z]{6,}", passage)] or ["it"]
        q = rng.choice(RAG_QUESTIONS).format(w=rng.choice(words))
        return f"Read the passage and answer the question using only the passage.\n\nPassage:\n{passage}\n\nQuestion: {q}"

    def chat():
        turns = [rng.choice(ADVICE).format(t=rng.choice(topics))]
        if rng.random() < 0.5:
            turns.append(rng.choice(FOLLOW_UPS))
        return turns

    makers = [(question, 4), (math, 2), (translation, 2), (codegen, 3), (code_edit, 3), (summary, 2), (rag, 2),
              (chat, 2)]
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
