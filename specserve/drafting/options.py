"""Per-request drafting settings, declared by the method that reads them.

Each setting is one `Option`: its name is the field of a request body, the key of generation_config.json
and of `EngineConfig.draft_options`, and (dashed) the command-line flag. `num_assistant_tokens` belongs to
every method; the others to their proposer class (`Proposer.options`). A request's value resolves from the
request, then the engine's flag, then generation_config.json, then the option's default.
"""
from __future__ import annotations

from dataclasses import dataclass


AUTO = "auto"


@dataclass(frozen=True, slots=True)
class Option:
    name: str
    default: int | float | str
    minimum: int | float
    help: str
    maximum: int | float | None = None
    aliases: tuple[str, ...] = ()     # other spellings accepted for it (transformers' names)
    off: int | None = None            # the value that asks nothing of the method: others accept only this
    kind: type = int                  # int, or float (an int is taken for a float)
    auto: bool = False                # "auto" is a value too (the engine chooses)

    def check(self, value: object, where: str = "") -> int | float | str:
        """The value (an int, a float, or "auto"), or ValueError naming the option (and where it was set)."""
        if self.auto and value == AUTO:
            return value
        number = (int, float) if self.kind is float else int
        if isinstance(value, bool) or not isinstance(value, number) or value != value:
            kind = ("a number" if self.kind is float else "an integer") + (' or "auto"' if self.auto else "")
            raise ValueError(f"{self.name} must be {kind}, got {value!r}{where}")
        if value < self.minimum or (self.maximum is not None and value > self.maximum):
            bound = f"in [{self.minimum}, {self.maximum}]" if self.maximum is not None else f">= {self.minimum}"
            raise ValueError(f"{self.name} must be {bound}, got {value}{where}")
        return self.kind(value)


MAX_NUM_ASSISTANT_TOKENS = 32
AUTO_MAX_DRAFT_TOKENS = 8       # the longest draft "auto" chooses (engine/draft_policy.py)
NUM_ASSISTANT_TOKENS = Option("num_assistant_tokens", AUTO, 0, "draft tokens per step (0: no drafting; auto: "
                              "chosen per step for the batch's throughput)", maximum=MAX_NUM_ASSISTANT_TOKENS, auto=True)
# the committed rows a deferring drafter (EAGLE3's head, MTP's layers) runs over at most when it starts or resumes
# drafting for a sequence: the rest of its backlog (a prompt, the steps it was held at 0) it skips (catch_up.py)
CATCH_UP_WINDOW = 64
# for drafters that draw from a distribution (draft model, MTP, an EAGLE3 chain): transformers' and OpenVINO's name
CONFIDENCE_THRESHOLD = Option("assistant_confidence_threshold", 0.0, 0.0, "stop a draft after a token the drafter "
                              "gives less than this probability (0: never)", maximum=1.0, kind=float)


def spellings(options: tuple[Option, ...]) -> dict[str, Option]:
    """Every accepted name (names and aliases) -> its option."""
    return {name: o for o in options for name in (o.name, *o.aliases)}


def canonical(values: dict[str, object], options: tuple[Option, ...], where: str = "") -> dict[str, int]:
    """values keyed by any spelling -> checked values keyed by option name; a name no option has is an error.
    A name given twice (an option and its alias) keeps the option's own spelling."""
    known = spellings(options)
    out: dict[str, int] = {}
    for key, value in values.items():
        if key not in known:
            raise ValueError(f"unknown drafting option {key!r}{where}; known: {', '.join(sorted(known))}")
        option = known[key]
        if key == option.name or option.name not in values:
            out[option.name] = option.check(value, where)
    return out


def reject_foreign(values: dict[str, int], method: str, every: dict[str, tuple[Option, ...]]) -> None:
    """ValueError when `values` set an option of another method (every: method -> its options) to anything but
    its `off` value: they ask for something the serving method does not do (a tree of an n-gram drafter)."""
    own = {o.name for o in every[method]}
    for name, value in values.items():
        owners = [m for m, options in every.items() if any(o.name == name and o.off not in (None, value)
                                                              for o in options)]
        if name not in own and owners:
            raise ValueError(f"{name}={value} needs a drafting method that has it ({', '.join(owners)}); "
                             f"this server drafts with {method!r}")


def resolve_options(requested: dict[str, int], own: tuple[Option, ...], defaults: dict[str, int]) -> dict[str, int]:
    """A request's value of each of `own`: its own, else the engine-wide one."""
    return {o.name: requested.get(o.name, defaults[o.name]) for o in own}
