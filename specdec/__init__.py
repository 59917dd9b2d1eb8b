"""specdec: speculative decoding you can read, with a benchmark you can trust."""
from .decoding import Generation, Stats, generate, speculative_generate
from .datastore import Datastore
from .head import HiddenHead, load_head
from .drafters import CompositeDrafter, DatastoreDrafter, Drafter, ModelDrafter, NgramDrafter
from .models.base import HFAdapter, LanguageModel, NativeLM
from .models.loading import DEFAULT_MODEL, hf_checkpoint, load_datastore, load_model, load_tokenizer
from .sampling import SamplingParams, logits_to_probs

__version__ = "0.1.0"

__all__ = [
    "generate", "speculative_generate", "Generation", "Stats",
    "load_model", "load_tokenizer", "load_datastore", "hf_checkpoint", "DEFAULT_MODEL",
    "load_head", "HiddenHead", "Drafter", "ModelDrafter", "NgramDrafter", "DatastoreDrafter", "CompositeDrafter", "Datastore",
    "LanguageModel", "NativeLM", "HFAdapter", "SamplingParams", "logits_to_probs",
]
