"""Which drafter a deployment uses: named by the user, or detected from configs (never from file names)."""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from specserve.config import SPEC_METHODS
from specserve.drafting.draft_model import DraftModelProposer
from specserve.drafting.eagle3 import Eagle3Proposer
from specserve.drafting.mtp import MTPProposer
from specserve.drafting.ngram import NgramProposer
from specserve.drafting.options import NUM_ASSISTANT_TOKENS, Option, canonical, reject_foreign, resolve_options, spellings
from specserve.drafting.proposer import NoProposer, Proposer
from specserve.models.config import ModelConfig
from specserve.models.registry import MODEL_REGISTRY
from specserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
#: config.json key of a drafter shipped in the package: the sha256 digests of the GGUF files it was trained for
TARGET_GGUF_KEY = "specserve_target_gguf_sha256"
CONVERSION_NAME = re.compile(r"([0-9a-f]{64})-(bfloat16|float16|float32)")
# --speculative-method -> its proposer
METHODS: dict[str, type[Proposer]] = {"none": NoProposer, "ngram": NgramProposer, "draft": DraftModelProposer,
                                      "eagle3": Eagle3Proposer, "mtp": MTPProposer}
assert tuple(METHODS) == SPEC_METHODS, "config.SPEC_METHODS names every method here"


def default_drafters_dir() -> Path:
    """The drafters shipped with the package for the default model (EAGLE3 head, draft model, MTP layers)."""
    return Path(__file__).resolve().parents[1] / "default_drafters"


def converted_from(model_dir: str | Path) -> str | None:
    """The sha256 of the GGUF file a folder of specserve's conversion cache was made from (the cache's key), else None."""
    from specserve.gguf.cache import cache_dir
    path = Path(model_dir).resolve()
    match = CONVERSION_NAME.fullmatch(path.name)
    return match.group(1) if match and path.parent == (cache_dir() / "gguf").resolve() else None


def shipped_drafters(model_dir: str | Path) -> list[Path]:
    """Shipped drafter folders whose config.json names the GGUF file the model was converted from."""
    digest, root = converted_from(model_dir), default_drafters_dir()
    if digest is None or not root.is_dir():
        return []
    return [sub for sub in sorted(root.iterdir()) if (sub / "config.json").exists()
            and digest in json.loads((sub / "config.json").read_text()).get(TARGET_GGUF_KEY, [])]


def drafter_kind(path: str | Path) -> str:
    """The kind of drafter stored in a folder, read from its config.json."""
    cfg_path = Path(path) / "config.json"
    if not cfg_path.exists():
        raise ValueError(f"drafter folder {path} has no config.json")
    cfg = json.loads(cfg_path.read_text())
    arch = (cfg.get("architectures") or [None])[0]
    if arch in EAGLE3_ARCHITECTURES:
        return "eagle3"
    if cfg.get("num_nextn_predict_layers", 0) and arch not in MODEL_REGISTRY:
        return "mtp"
    if arch in MODEL_REGISTRY:
        return "draft"
    raise ValueError(f"cannot tell what kind of drafter {path} holds: architecture {arch!r} is neither a "
                     f"supported causal LM ({', '.join(sorted(MODEL_REGISTRY))}) nor an EAGLE3 head")


def find_drafters(model_dir: str | Path) -> dict[str, Path]:
    """Drafters in subfolders of the model folder, by kind (the first subfolder of each kind, sorted), then
    those shipped for the model (a GGUF conversion the package has drafters for)."""
    found: dict[str, Path] = {}
    subfolders = sorted(p for p in Path(model_dir).iterdir() if p.is_dir() and (p / "config.json").exists())
    for sub in subfolders + shipped_drafters(model_dir):
        try:
            found.setdefault(drafter_kind(sub), sub)
        except ValueError as e:
            logger.warning("ignoring %s: %s", sub, e)
    return found


def resolve_method(config, model_config: ModelConfig) -> tuple[str, Path | None]:
    """(method, drafter path) from the engine config, detecting what the user did not name."""
    method, path = config.speculative_method, config.draft_model
    if path is not None:
        kind = drafter_kind(path)
        if method not in (None, kind):
            raise ValueError(f"--speculative-method {method} does not match the drafter in {path}, which is {kind}")
        return kind, Path(path)
    if method in ("none", "ngram"):
        return method, None
    found = find_drafters(config.model)
    if method is None:
        if model_config.num_nextn_predict_layers > 0:
            return "mtp", None
        for kind in ("eagle3", "draft", "mtp"):
            if kind in found:
                return kind, found[kind]
        return "none", None
    if method == "mtp" and model_config.num_nextn_predict_layers > 0:
        return "mtp", found.get("mtp")
    if method not in found:
        raise ValueError(f"--speculative-method {method} needs a drafter: pass --draft-model DIR "
                         f"(no {method} drafter found in a subfolder of {config.model})")
    return method, found[method]


def proposer_class(method: str) -> type[Proposer]:
    return METHODS[method]


def method_options(method: str) -> tuple[Option, ...]:
    """Every option a method reads: num_assistant_tokens (not for plain decoding), then its own."""
    cls = METHODS[method]
    return cls.options if cls is NoProposer else (NUM_ASSISTANT_TOKENS, *cls.options)


def options_by_method() -> dict[str, tuple[Option, ...]]:
    return {method: method_options(method) for method in METHODS}


def all_options() -> tuple[Option, ...]:
    """Every method's options, each once: the request fields, generation_config.json keys and flags there are."""
    return tuple({o.name: o for method in METHODS for o in method_options(method)}.values())


def engine_draft_defaults(method: str, config, generation: dict) -> dict[str, int | float | str]:
    """The engine-wide value of each option of the serving method: the engine's flag (config: an EngineConfig),
    then the model's generation_config.json (`generation`), then the option's default."""
    every, known = options_by_method(), spellings(all_options())
    flags = dict(config.draft_options)
    if config.num_assistant_tokens is not None:
        flags["num_assistant_tokens"] = config.num_assistant_tokens
    flags = canonical(flags, all_options(), " (engine option)")
    reject_foreign(flags, method, every)
    gen = canonical({k: v for k, v in generation.items() if k in known}, all_options(),
                    f" in {config.model}/generation_config.json")
    return {o.name: flags.get(o.name, gen.get(o.name, o.default)) for o in every[method]}


def resolve_request_options(params: SamplingParams, method: str, proposer: Proposer, defaults: dict) -> None:
    """Fill a request's unset drafting settings from the engine's and check them (the method checks what is its
    own: tree settings, its limits); ValueError names what is wrong."""
    requested = canonical(params.draft_options, all_options())
    reject_foreign(requested, method, options_by_method())
    if params.num_assistant_tokens is None:
        params.num_assistant_tokens = defaults.get(NUM_ASSISTANT_TOKENS.name, 0)
    NUM_ASSISTANT_TOKENS.check(params.num_assistant_tokens)
    params.draft_options = resolve_options(requested, proposer.options, defaults)
    proposer.check(params)
