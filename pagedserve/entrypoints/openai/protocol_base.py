"""The pieces every request and response model of the OpenAI API builds on (protocol.py has
the models): strict request validation, the field audit behind "no silent drops", errors, ids."""
from __future__ import annotations

import re
import time
import uuid
from typing import Annotated, Any, ClassVar, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

MAX_STOP = 16
MAX_SEED = 2**63 - 1
MAX_TOKEN_ID = 2**31 - 1


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore", ser_json_inf_nan="null")


_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def _check_text(value: Any) -> None:
    """Raise ValueError for a string (anywhere in lists and dict keys/values) holding a lone
    UTF-16 surrogate: JSON can escape one ("\\ud800", a JavaScript string cut inside an emoji),
    but it is no Unicode text, so no tokenizer or UTF-8 encoder downstream can take it.
    Iterative: a value nested about 960 deep (as deep as the body's JSON parser goes) ran a
    recursive walk out of Python's recursion limit, a 500."""
    todo = [value]
    while todo:
        value = todo.pop()
        if isinstance(value, str):
            m = _LONE_SURROGATE.search(value)
            if m:
                raise ValueError(f"contains a lone UTF-16 surrogate (U+{ord(m.group()):04X}) at "
                                 f"character {m.start()}, which is not valid Unicode text")
        elif isinstance(value, list):
            # Runs after type validation, so a list is all of one type: token ids need no look.
            if value and not isinstance(value[0], (int, float)):
                todo.extend(value)
        elif isinstance(value, dict):
            for k, v in value.items():
                todo.append(k)
                todo.append(v)


class Request(OpenAIModel):
    """Base of every request body: also refuses lone surrogates in any of its text fields.

    Strict, as OpenAI's schema is: no "16" for an integer, "yes" or 1 for a boolean, true for a
    token id (a 400 naming the field); a float field still takes a JSON integer."""
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        _check_text(value)
        return value


# ---- errors --------------------------------------------------------------------------------

class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[str, int]] = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo


# ---- shared request pieces ------------------------------------------------------------------

class StreamOptions(Request):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False
    include_obfuscation: Optional[bool] = None


Stop = Union[Annotated[str, Field(min_length=1)],
             Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=MAX_STOP)], None]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]


# ---- the field audit (issue #32) ------------------------------------------------------------
# FieldAudit.UNSUPPORTED lists the OpenAI and vLLM fields pagedserve accepts only at their no-op
# value; serving_common.OpenAIServing.audit turns any other value into a 400 naming the field and
# logs the keys outside the API (ignored, as vLLM ignores them).

class FieldAudit(Request):
    """Remembers the request keys outside the model (ignored, as vLLM ignores them) and lists the
    OpenAI fields accepted only at a no-op value: {field: (accepted values besides None, why)}."""
    UNSUPPORTED: ClassVar[dict[str, tuple[tuple, str]]] = {}
    # A plain default, not default_factory=list: pydantic 2.13 calls inspect.signature on a private
    # attribute's factory for every instance, and a builtin's signature (from its text, through
    # ast and a copy of sys.modules) leaves ~26 objects of cyclic garbage: on the H200, after ~850
    # requests, a young collection of 33,488 such objects stalled the API server for 174 ms.
    _unknown_keys: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _remember_unknown(cls, data: Any, handler: Any) -> Any:
        obj = handler(data)
        if isinstance(data, dict) and isinstance(obj, FieldAudit):
            obj._unknown_keys = tuple(sorted(k for k in data if k not in cls.model_fields))
        return obj

    def unsupported_fields(self) -> list[tuple[str, str]]:
        """(field, why) of each UNSUPPORTED field set to something other than its no-op value."""
        out = []
        for name, (noops, why) in self.UNSUPPORTED.items():
            value = getattr(self, name, None)
            if value is None or any(value == ok for ok in noops):
                continue
            out.append((name, why))
        return out
