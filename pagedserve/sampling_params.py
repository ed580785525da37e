"""SamplingParams: how one request is decoded. Field names follow vLLM so users can switch."""
from __future__ import annotations

import enum
import json
import logging
import numbers
import dataclasses
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

MAX_N = 128
# vLLM's floor (its _MAX_TEMP): a temperature in (0, 0.01) is raised to 0.01, with a warning.
# Below it, in float32, the temperature rounds to 0 (under ~1e-45) or the logits divided by it
# overflow: the softmax is NaN, and the draw returned token 0 every step, whatever the model said.
MIN_TEMPERATURE = 1e-2
# repetition_penalty divides the positive logits of seen tokens: below this, the same float32
# trouble as a tiny temperature (1e-300 is 0: inf logits, a NaN softmax, token 0 drawn).
MIN_REPETITION_PENALTY = 1e-2


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request carries (vLLM's names).

    CUMULATIVE: everything generated so far, every step the request advanced.
    DELTA: only what is new since that request's previous output (token_ids, text, logprobs);
        cumulative_logprob, finish_reason and stop_reason stay whole-request values.
    FINAL_ONLY: one output, when the request finishes (the same as CUMULATIVE's last).
    """
    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


# The deepest nesting of lists and objects accepted in a JSON Schema. jsonschema's meta-schema
# check recurses several Python frames a level and reached the interpreter's limit near 100 levels
# of subschemas (a RecursionError: the server answered 500); real schemas nest a few levels.
MAX_SCHEMA_DEPTH = 64


def _type_names(types: type | tuple) -> str:
    return " or ".join(t.__name__ for t in (types if isinstance(types, tuple) else (types,)))


def json_depth(value: Any) -> int:
    """How deeply lists and dicts nest in value (0 for a scalar). Iterative: it runs before
    whatever would recurse too deep."""
    depth, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            continue
        depth = max(depth, d)
        todo.extend((x, d + 1) for x in v)
    return depth


def check_json_depth(schema: Any, param: str = "structured_outputs.json") -> None:
    """ValueError naming param when schema nests deeper than MAX_SCHEMA_DEPTH. The one owner of
    this check and its words: the engine's compiler (offline) and the API server (its 400, before
    the meta-schema check that would recurse) both call it."""
    depth = json_depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(f"{param} nests lists and objects {depth} deep; at most {MAX_SCHEMA_DEPTH} "
                         "levels are accepted")


def is_int(v: Any) -> bool:
    """An integer, numpy's too; not a bool (True as n or a token id is a slip, not a count) and
    not a float (2.5 tokens, or 2.0 of them: vLLM's "must be an int")."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def is_real(v: Any) -> bool:
    """A number for a float field (an int is one); not a bool, not a numeric string."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def check_types(obj: Any, ints: tuple = (), opt_ints: tuple = (), reals: tuple = (), bools: tuple = ()) -> None:
    """TypeError naming the field, before any range check compares it: without it a string or
    None failed with Python's "'<' not supported between 'float' and 'str'", naming nothing,
    and a float count (max_tokens=2.5, n=1.5, seed=1.5) either ran as something else or failed
    inside the engine's step."""
    for names, ok, what in ((ints, is_int, "an integer"), (reals, is_real, "a number"),
                            (bools, lambda v: isinstance(v, bool), "a bool")):
        for name in names:
            if not ok(getattr(obj, name)):
                raise TypeError(f"{name} must be {what}, got {getattr(obj, name)!r}")
    for name in opt_ints:
        v = getattr(obj, name)
        if v is not None and not is_int(v):
            raise TypeError(f"{name} must be an integer or None, got {v!r}")
    for name in ints + opt_ints:  # numpy integers become Python ones (tensors, JSON, hashing)
        v = getattr(obj, name)
        if v is not None and type(v) is not int:
            setattr(obj, name, int(v))


def token_id_list(name: str, v: Any) -> list[int]:
    """A list (or tuple) of integer token ids, as a list; TypeError naming the field otherwise
    (a string iterated to characters, a float never matching any token, None failing a step)."""
    if not isinstance(v, (list, tuple)) or not all(is_int(t) for t in v):
        raise TypeError(f"{name} must be a list of integer token ids, got {v!r}")
    return [int(t) for t in v]


@dataclass
class StructuredOutputsParams:
    """Constrains a request's output to a grammar; exactly one kind is set (vLLM's names).

    json: a JSON Schema (dict or its JSON text). json_object: any JSON object. regex, choice
    (one of these strings), grammar (EBNF, xgrammar's GBNF dialect), structural_tag (xgrammar's
    structural-tag JSON: free text with tagged, schema-constrained regions, as tool calls use).
    The engine compiles it (engine/structured/), fills a token bitmask per step and finishes the
    sequence with finish_reason "stop" once the grammar has closed.
    """
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

    def __post_init__(self) -> None:
        for name, types in (("json", (str, dict)), ("regex", str), ("choice", list), ("grammar", str),
                            ("json_object", bool), ("structural_tag", (str, dict)),
                            ("whitespace_pattern", str)):
            v = getattr(self, name)
            if v is not None and not isinstance(v, types):
                # A string choice passed the element check character by character ("abc": a, b or c).
                raise TypeError(f"structured_outputs.{name} must be {_type_names(types)} or None, got {v!r}")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"structured_outputs.{name} must be a bool, got {getattr(self, name)!r}")
        set_kinds = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError("structured_outputs must set exactly one of "
                             f"{', '.join(self.KINDS)}; got {set_kinds or 'none'}")
        if self.choice is not None and (not self.choice or
                                        not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of strings")

    @classmethod
    def coerce(cls, value: Any) -> "StructuredOutputsParams | None":
        """A structured_outputs argument as the dataclass (a bare string failed in the engine
        with "'str' object has no attribute 'kind'")."""
        return _coerce_params(cls, value, "structured_outputs")

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, canonical spec text): what a compiled grammar is cached by (with the tokenizer)."""
        value: Any = getattr(self, self.kind)
        if isinstance(value, (dict, list)):
            value = json.dumps(value, sort_keys=True, separators=(",", ":"))
        opts = (self.disable_any_whitespace, self.disable_additional_properties,
                self.whitespace_pattern)
        return self.kind, f"{value}|{opts}"


@dataclass
class RepetitionDetectionParams:
    """vLLM's repetition_detection: finish a sequence (finish_reason "repetition", stop_reason
    "repetition_detected") once its output ends in a pattern of min_pattern_size (0: 1) to
    max_pattern_size tokens repeated min_count times in a row (engine/repetition.py)."""
    max_pattern_size: int = 0  # 0: off
    min_pattern_size: int = 0
    min_count: int = 0

    def __post_init__(self) -> None:
        for name in ("max_pattern_size", "min_pattern_size", "min_count"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"repetition_detection.{name} must be an integer, got {v!r}")
        if self.max_pattern_size < 0 or self.min_pattern_size < 0 or self.min_pattern_size > self.max_pattern_size:
            raise ValueError("repetition_detection: max_pattern_size and min_pattern_size must be >= 0, "
                             "with min_pattern_size <= max_pattern_size (both 0: off)")
        if self.max_pattern_size > 0 and self.min_count < 2:
            raise ValueError(f"repetition_detection.min_count must be >= 2, got {self.min_count}")

    @classmethod
    def coerce(cls, value: Any) -> "RepetitionDetectionParams | None":
        return _coerce_params(cls, value, "repetition_detection")


def _coerce_params(cls: type, value: Any, name: str) -> Any:
    """A SamplingParams field holding the dataclass cls: a dict of its fields is built into one;
    anything else but the dataclass or None is a TypeError naming the field."""
    if isinstance(value, dict):
        unknown = sorted(set(value) - {f.name for f in dataclasses.fields(cls)}, key=str)
        if unknown:
            raise TypeError(f"{name} has no field {unknown[0]!r}; its fields: "
                            f"{', '.join(f.name for f in dataclasses.fields(cls))}")
        return cls(**value)
    if value is not None and not isinstance(value, cls):
        raise TypeError(f"{name} must be a {cls.__name__} or a dict of its fields, got {value!r}")
    return value


@dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    # False (with skip_special_tokens=False): no spaces between added tokens in the text, as vLLM
    # honours it (engine/detokenizer.py: a fast tokenizer's added tokens after one another bare).
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    # Added to the logits before any filter (OpenAI's: token id -> bias in [-100, 100]); logprobs
    # stay the model's raw ones, as for every other processing.
    logit_bias: dict[int, float] | None = None
    # Only these tokens may be drawn (vLLM's).
    allowed_token_ids: list[int] | None = None
    # Words never generated (vLLM's; engine/bad_words.py); their token ids, filled where the
    # tokenizer is (left None, the engine fills them).
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    # False: outputs carry token ids only, text "" and Logprob.decoded_token None (vLLM's); no
    # stop strings then, which need the text.
    detokenize: bool = True
    # Keep N of the prompt's tokens, as vLLM does: the last N ids of token ids; a text prompt is
    # tokenized with the tokenizer's left truncation to N, keeping the special tokens it adds (a
    # BOS). -1: max_model_len. The engine's InputProcessor applies it before the length checks
    # (input_processor.truncated_prompt).
    truncate_prompt_tokens: int | None = None
    # Finish on a repeated token pattern (vLLM's; RepetitionDetectionParams).
    repetition_detection: RepetitionDetectionParams | None = None

    def __post_init__(self) -> None:
        self._check_types()
        self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)
        self.repetition_detection = RepetitionDetectionParams.coerce(self.repetition_detection)
        if not isinstance(self.output_kind, RequestOutputKind):
            try:
                self.output_kind = RequestOutputKind(self.output_kind)
            except ValueError:
                names = ", ".join(k.value for k in RequestOutputKind)
                raise ValueError(f"output_kind must be a RequestOutputKind or one of {names}, "
                                 f"got {self.output_kind!r}") from None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = token_id_list("stop_token_ids", self.stop_token_ids or [])
        if self.best_of is None:
            self.best_of = self.n
        if self.top_k == 0:
            self.top_k = -1
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            logger.warning("temperature %s is less than %s, which may cause numerical errors nan or inf "
                           "in tensors. We have maxed it out to %s.", self.temperature, MIN_TEMPERATURE,
                           MIN_TEMPERATURE)  # vLLM's words
            self.temperature = MIN_TEMPERATURE
        self._validate()

    def _check_types(self) -> None:
        """Each field's type, before __post_init__'s normalising and _validate's ranges read it."""
        check_types(self, ints=("n", "top_k", "min_tokens"),
                    opt_ints=("best_of", "seed", "max_tokens", "logprobs", "prompt_logprobs"),
                    reals=("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                           "repetition_penalty"),
                    bools=("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
                           "include_stop_str_in_output", "detokenize"))
        if self.stop is not None and not isinstance(self.stop, str) and not (
                isinstance(self.stop, (list, tuple)) and all(isinstance(x, str) for x in self.stop)):
            raise TypeError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = token_id_list("allowed_token_ids", self.allowed_token_ids)
        if self.bad_words is not None and not isinstance(self.bad_words, (list, tuple)):
            # A bare string was taken as a list of one-character words.
            raise TypeError(f"bad_words must be a list of strings, got {self.bad_words!r}")
        if self.bad_words_token_ids is not None:
            if not isinstance(self.bad_words_token_ids, (list, tuple)):
                raise TypeError(f"bad_words_token_ids must be a list of token id lists, got {self.bad_words_token_ids!r}")
            self.bad_words_token_ids = [token_id_list("bad_words_token_ids", w) for w in self.bad_words_token_ids]
            if not all(self.bad_words_token_ids):
                # An empty word failed the engine's step (IndexError) with every request in it.
                raise ValueError("bad_words_token_ids must not contain an empty list")
        if self.logit_bias is not None and isinstance(self.logit_bias, dict):
            bad_bias = [b for b in self.logit_bias.values() if not is_real(b)]
            if bad_bias:
                raise TypeError(f"logit_bias values must be numbers, got {bad_bias[0]!r}")

    def _validate(self) -> None:
        def bad(name: str, limit: str) -> None:
            raise ValueError(f"{name} must be {limit}, got {getattr(self, name)!r}")

        if not 1 <= self.n <= MAX_N:
            bad("n", f"in [1, {MAX_N}]")
        if not self.n <= self.best_of <= MAX_N:
            bad("best_of", f"in [n={self.n}, {MAX_N}]")
        if not 0.0 <= self.temperature <= 100.0:
            bad("temperature", "in [0, 100]")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "in (0, 1]")
        if self.top_k < -1:
            bad("top_k", "-1 (off), 0 (off) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "in [0, 1]")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", ">= 1")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad("min_tokens", "in [0, max_tokens]")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "in [-2, 2]")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 2.0:
            bad("repetition_penalty", f"in [{MIN_REPETITION_PENALTY}, 2]")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and v < -1:  # the upper bound is the engine's max_logprobs (input_processor)
                bad(name, ">= 0, or -1 (the whole vocabulary)")
        t = self.truncate_prompt_tokens
        if t is not None and (not isinstance(t, int) or isinstance(t, bool) or t == 0 or t < -1):
            bad("truncate_prompt_tokens", ">= 1, or -1 (max_model_len)")  # its upper bound: the engine's
        if self.seed is not None and not 0 <= self.seed < 2**63:
            bad("seed", "in [0, 2**63)")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                    isinstance(t, int) and not isinstance(t, bool) for t in self.logit_bias):
                raise ValueError(f"logit_bias must map token ids (integers) to biases, got {self.logit_bias!r}")
            bad_bias = [b for b in self.logit_bias.values() if not -100.0 <= b <= 100.0]
            if bad_bias:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bad_bias[0]!r}")
        if self.allowed_token_ids is not None and (
                not self.allowed_token_ids or
                not all(isinstance(t, int) and not isinstance(t, bool) for t in self.allowed_token_ids)):
            raise ValueError("allowed_token_ids must be a non-empty list of token ids")
        if self.bad_words is not None and not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            raise ValueError("bad_words must be a list of non-blank strings")
        if any(not s for s in self.stop):
            raise ValueError("stop must not contain empty strings")
        if self.stop and not self.detokenize:  # vLLM's words
            raise ValueError("stop strings are only supported when detokenize is True. "
                             "Set detokenize=True to use stop.")
        if self.best_of > 1 and self.temperature == 0.0 and self.n > 1:
            raise ValueError("n > 1 needs temperature > 0: greedy samples would all be identical")
        if self.output_kind is RequestOutputKind.DELTA and self.best_of != self.n:
            raise ValueError(f"best_of must equal n ({self.n}) with output_kind=delta: which "
                             f"sequences are the best can change until the end, got {self.best_of}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


# |length_penalty| bound: for any generated length below 2**31, len ** length_penalty stays a
# finite, non-zero float (2**(31 * 32) = 2**992 < 2**1024, the float range).
MAX_LENGTH_PENALTY = 32


@dataclass
class BeamSearchParams:
    """LLM.beam_search settings, in vLLM's shape; scoring follows HF's BeamSearch with early_stopping=True.

    A finished hypothesis scores cum_logprob / generated_len ** length_penalty (generated_len counts
    the EOS token). temperature is accepted and checked, but the scores are the raw log-probabilities
    whatever it is: vLLM's LLM.beam_search scores with the logprobs of a one-token request, which V1
    takes before temperature (its default logprobs_mode, raw_logprobs), and HF's num_beams ignores
    temperature without do_sample. (vLLM's one-token request may also draw a token outside the top
    2 * beam_width at temperature > 0; such a candidate is beaten by 2 * beam_width of its own beam's,
    so it never survives.)

    Every hypothesis carries the logprobs of each step that produced its tokens
    (BeamSearchSequence.logprobs): the top max(2 * beam_width, logprobs) tokens of that step's
    distribution, the 2 * beam_width its candidates came from at least.
    """
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    # Every beam follows this grammar (its forbidden tokens are no candidates); pagedserve's addition.
    structured_outputs: StructuredOutputsParams | None = None
    # pagedserve's addition: top tokens each step records beyond the 2 * beam_width candidates
    # (-1: the whole vocabulary; at most the engine's max_logprobs). The server sets it to the
    # request's logprobs / top_logprobs; set (0 too), a search served to the server carries
    # each position's chosen token and top `logprobs` back to it, as a sampled request does.
    logprobs: int | None = None

    def __post_init__(self) -> None:
        check_types(self, ints=("beam_width", "max_tokens"), opt_ints=("logprobs",),
                    reals=("temperature", "length_penalty"), bools=("ignore_eos",))
        self.structured_outputs = StructuredOutputsParams.coerce(self.structured_outputs)
        if not 1 <= self.beam_width <= MAX_N:
            raise ValueError(f"beam_width must be in [1, {MAX_N}], got {self.beam_width!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        if not 0.0 <= self.temperature <= 100.0:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not -MAX_LENGTH_PENALTY <= self.length_penalty <= MAX_LENGTH_PENALTY:
            # Past it, generated_len ** length_penalty overflows (or underflows to 0 and the score
            # divides by it) in the engine's step, which fails every request in flight.
            raise ValueError(f"length_penalty must be in [-{MAX_LENGTH_PENALTY}, {MAX_LENGTH_PENALTY}], "
                             f"got {self.length_penalty!r}")
        if self.logprobs is not None and self.logprobs < -1:
            raise ValueError(f"logprobs must be >= 0, or -1 (the whole vocabulary), got {self.logprobs!r}")
