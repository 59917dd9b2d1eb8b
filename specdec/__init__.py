"""specdec: speculative decoding you can read, with a benchmark you can trust."""
from .datastore import Datastore, load_datastore
from .decoding import generate, speculative_generate
from .drafters import CompositeDrafter, DatastoreDrafter, Drafter, ModelDrafter, NgramDrafter, default_drafter
from .models.base import LanguageModel
from .models.hf import HFAdapter
from .models.loading import hf_checkpoint, load_model, load_tokenizer
from .models.native import NativeLM
from .models.registry import DEFAULT_MODEL
from .request import Generation, Stats
from .sampling import SamplingParams, logits_to_probs
from .schedule import AdaptiveK, FixedK

__version__ = "0.1.0"

__all__ = [
    "generate", "speculative_generate", "Generation", "Stats", "default_drafter",
    "load_model", "load_tokenizer", "load_datastore", "hf_checkpoint", "DEFAULT_MODEL",
    "Drafter", "ModelDrafter", "NgramDrafter", "DatastoreDrafter", "CompositeDrafter", "Datastore",
    "AdaptiveK", "FixedK", "LanguageModel", "NativeLM", "HFAdapter", "SamplingParams", "logits_to_probs",
]
