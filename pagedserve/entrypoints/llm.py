"""LLM: offline batched generation, chat and beam search, in vLLM's shape.

The engine core lives in this process behind an InprocCoreClient: the same client interface
the server uses over ZMQ, with no IPC and no encoding. `llm_engine` is the core's LLMEngine.
While generate and beam_search run, what the process held before is out of the garbage
collector's reach (engine/pauses.py, heap_frozen_meanwhile): a full collection walks every
tracked object, the model's modules and all that was imported (79-98 ms on our CPU with the demo
model, benchmarks/offline/offline_host.py), and one most likely landed in the middle of an H200 fixed256 run as a 190 ms stall of the GPU
(benchmarks/results/h200/runs/836bf4b_offline_steps/).
"""
from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any, Sequence as Seq

from tqdm.auto import tqdm

from pagedserve.config import EngineConfig
from pagedserve.engine.core_client import InprocCoreClient
from pagedserve.engine.llm_engine import make_engine_config
from pagedserve.engine.pauses import heap_frozen_meanwhile
from pagedserve.outputs import BeamSearchOutput, RequestOutput
from pagedserve.sampling_params import BeamSearchParams, SamplingParams

PromptType = str | list[int] | dict
# pydantic's names of a union's branches in an error's location (content: str | list[TextPart]).
_UNION_TAGS = frozenset({"str", "int", "float", "bool", "none"})


class LLM:
    def __init__(self, model: str, *, tokenizer: str | None = None, dtype: Any = "auto",
                 device: str = "auto", seed: int = 0, block_size: int = 16,
                 gpu_memory_utilization: float = 0.9, num_gpu_blocks_override: int | None = None,
                 swap_space: float = 4, max_num_seqs: int | None = None,
                 max_num_batched_tokens: int | None = None, max_model_len: int | None = None,
                 enable_prefix_caching: bool = True, preemption_mode: str = "auto",
                 enable_chunked_prefill: bool = True, enforce_eager: bool = False,
                 load_format: str = "auto", skip_tokenizer_init: bool = False,
                 tensor_parallel_size: int = 1, kv_allocator: str = "paged", **kwargs: Any):
        if type(dtype).__module__ == "torch" and type(dtype).__name__ == "dtype":
            # vLLM takes a torch.dtype too (LLM(dtype=torch.float16)); the config keeps its name
            # (config.py stays torch-free). A dtype outside DTYPES is still the config's ValueError.
            dtype = str(dtype).removeprefix("torch.")
        config = make_engine_config(
            model, tokenizer=tokenizer, dtype=dtype, device=device, seed=seed, block_size=block_size,
            gpu_memory_utilization=gpu_memory_utilization, num_gpu_blocks_override=num_gpu_blocks_override,
            swap_space=swap_space, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, enable_prefix_caching=enable_prefix_caching,
            preemption_mode=preemption_mode, enable_chunked_prefill=enable_chunked_prefill,
            enforce_eager=enforce_eager, load_format=load_format, skip_tokenizer_init=skip_tokenizer_init,
            tensor_parallel_size=tensor_parallel_size, kv_allocator=kv_allocator, **kwargs)
        self._init_from_config(config)

    def _init_from_config(self, config: EngineConfig) -> None:
        from pagedserve.engine.generation_defaults import config_generation_defaults
        self._default_sampling = config_generation_defaults(config)
        self.engine_core = InprocCoreClient(config)
        self.llm_engine = self.engine_core.engine
        self._ids = itertools.count()

    @classmethod
    def from_engine_config(cls, config: EngineConfig) -> "LLM":
        llm = cls.__new__(cls)
        llm._init_from_config(config)
        return llm

    def get_tokenizer(self) -> Any:
        return self.llm_engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate and chat use without sampling_params: SamplingParams' defaults, with the
        model's generation config on top (--generation-config, engine/generation_defaults.py)."""
        return SamplingParams(**self._default_sampling)

    def shutdown(self) -> None:
        """Stop the engine's worker processes (tensor parallelism); the LLM is unusable afterwards."""
        self.engine_core.shutdown()

    def get_kv_cache_stats(self):
        return self.llm_engine.get_kv_cache_stats()

    def get_spec_decode_stats(self):
        """Speculative decoding's counters (pagedserve.spec_decode.stats.SpecDecodeStats), or None."""
        return self.llm_engine.get_spec_decode_stats()

    @staticmethod
    def _as_list(prompts: PromptType | Seq[PromptType]) -> list[PromptType]:
        # bytes and non-iterables (None, a number) are one prompt, which the InputProcessor refuses
        # naming the prompt: list(None) failed as "'NoneType' object is not iterable", and list(b"hi")
        # ran the byte values as token ids.
        if isinstance(prompts, (str, dict, bytes)) or not isinstance(prompts, Iterable):
            return [prompts]
        prompts = list(prompts)
        # A flat list of ints is one tokenized prompt, not many.
        if prompts and all(isinstance(t, int) for t in prompts):
            return [prompts]
        return prompts

    def generate(self, prompts: PromptType | Seq[PromptType],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Seq[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order. Without sampling_params:
        get_default_sampling_params() (the model's generation config, as vLLM). priority: one per
        prompt (vLLM's; lower first), with scheduling_policy="priority"."""
        prompts = self._as_list(prompts)
        priorities = [0] * len(prompts) if priority is None else list(priority)
        if len(priorities) != len(prompts):
            raise ValueError(f"priority must be one per prompt: got {len(priorities)} for {len(prompts)} prompts")
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, dict) or not isinstance(sampling_params, Iterable):
            # A dict was iterated to its keys, and then refused as "got str".
            raise ValueError(f"sampling_params must be a SamplingParams or a list of them (one per prompt), "
                             f"got {type(sampling_params).__name__}")
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"sampling_params must be one per prompt: got {len(params)} "
                                 f"for {len(prompts)} prompts")
        core = self.engine_core
        order: dict[str, int] = {}
        try:
            for i, (prompt, sp) in enumerate(zip(prompts, params)):
                rid = str(next(self._ids))
                core.add_request(rid, prompt, sp, priority=priorities[i])
                order[rid] = i
        except Exception:
            core.abort_requests(list(order))
            raise
        results: list[RequestOutput | None] = [None] * len(prompts)
        try:
            with heap_frozen_meanwhile(), tqdm(total=len(prompts), desc="Processed prompts",
                                               disable=not use_tqdm) as bar:
                remaining = len(order)
                while remaining and core.has_unfinished_requests():
                    for out in core.get_output(final_only=True).outputs:
                        if out.request_id in order:
                            results[order[out.request_id]] = out
                            remaining -= 1
                            bar.update(1)
        except BaseException:
            core.abort_requests(list(order))
            raise
        return results  # type: ignore[return-value]

    def chat(self, messages: Seq[dict] | Seq[Seq[dict]],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             chat_template_content_format: str | None = None) -> list[RequestOutput]:
        """Generate a reply to one conversation (a list of OpenAI-style messages) or to each of a
        list of them, as vLLM's LLM.chat: each is rendered by the chat template (chat_template: a
        Jinja file's path or the template's text as it is, for this call; else the engine's
        --chat-template, else the tokenizer's) exactly as /v1/chat/completions renders it, message text never becoming a
        control token. tools go to the template as they are; nothing parses calls out of the
        reply. chat_template_content_format: as the engine's (auto, string, openai) for this call.
        ValueError names the conversation and field of a message that is not valid."""
        from pagedserve.config import CHAT_TEMPLATE_CONTENT_FORMATS
        from pagedserve.engine.chat_template import resolve_chat_template
        fmt = chat_template_content_format or self.llm_engine.config.chat_template_content_format
        if fmt not in CHAT_TEMPLATE_CONTENT_FORMATS:
            raise ValueError(f"chat_template_content_format must be one of {CHAT_TEMPLATE_CONTENT_FORMATS}, got {fmt!r}")
        template = resolve_chat_template(chat_template, read_escapes=False)  # a path, or the text as it is
        if not isinstance(messages, (list, tuple)):  # a string was read as a list of one-letter messages
            raise TypeError(f"messages must be a list of message dicts, or a list of such lists, "
                            f"got {type(messages).__name__}")
        many = bool(messages) and not isinstance(messages[0], dict)
        conversations = list(messages) if many else [messages]
        prompts = [{"prompt_token_ids": self._chat_ids(f"messages[{i}]" if many else "messages", conv,
                                                       template, add_generation_prompt,
                                                       continue_final_message, tools, chat_template_kwargs, fmt)}
                   for i, conv in enumerate(conversations)]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _chat_ids(self, where: str, conversation: Seq[dict], template: str | None,
                  add_generation_prompt: bool, continue_final_message: bool, tools: list[dict] | None,
                  chat_template_kwargs: dict[str, Any] | None, content_format_setting: str = "auto") -> list[int]:
        """One conversation's prompt ids (where: how errors name it), as serving_chat renders them."""
        import pydantic

        from pagedserve.entrypoints.openai.chat_render import TEMPLATE_ARGS
        from pagedserve.entrypoints.openai.chat_tokens import content_format, render_chat_ids
        from pagedserve.entrypoints.openai.protocol import ChatMessage
        from pagedserve.entrypoints.openai.serving_common import APIError
        from pagedserve.entrypoints.openai.tools import check_history, history_message
        tok = self.get_tokenizer()
        if tok is None:
            raise ValueError("chat needs a tokenizer (this LLM was made with skip_tokenizer_init)")
        for name, v in (("add_generation_prompt", add_generation_prompt),
                        ("continue_final_message", continue_final_message)):
            if not isinstance(v, bool):  # "no" was taken as True
                raise TypeError(f"{name} must be a bool, got {v!r}")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt=False")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise TypeError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}")
        kwargs = dict(chat_template_kwargs or {})
        # As the server refuses them (chat_render.TEMPLATE_ARGS): chat's own arguments, which
        # clashed with it in "got multiple values for argument" TypeErrors.
        clash = sorted(TEMPLATE_ARGS & set(kwargs))
        if clash:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(clash)} (chat's own arguments)")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise TypeError(f"tools must be a list of dicts (OpenAI tool definitions), got {tools!r}"[:200])
        if template is not None:
            kwargs["chat_template"] = template
        elif not getattr(tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template: pass chat_template= "
                             "(to chat, or to LLM(...)), or use generate()")
        if not conversation:
            raise ValueError(f"{where}: a conversation needs at least one message")
        parsed = []
        for j, m in enumerate(conversation):
            try:
                parsed.append(ChatMessage.model_validate(m))
            except pydantic.ValidationError as e:
                # The deepest error, without pydantic's union-branch names: the first was content's
                # "str" branch, so a content part of an unknown type read "content.str: Input
                # should be a valid string".
                err = max(e.errors(), key=lambda x: len(x["loc"]))
                field = ".".join(str(x) for x in err["loc"] if not (isinstance(x, str) and x in _UNION_TAGS)
                                 and not (isinstance(x, str) and x.startswith(("list[", "dict["))))
                raise ValueError(f"{where}[{j}]{'.' + field if field else ''}: {err['msg']}") from None
        try:
            check_history(parsed)
        except APIError as e:  # its param is "messages.J.field"
            raise ValueError(f"{where}[{e.param.split('.')[1]}].{e.param.split('.', 2)[2]}: {e.message}") from None
        fmt = content_format(tok, content_format_setting, template)
        try:
            return render_chat_ids(tok, [history_message(m, fmt) for m in parsed], add_generation_prompt,
                                   tools=tools, continue_final_message=continue_final_message, **kwargs)
        except ValueError:
            raise
        except Exception as e:  # jinja's TemplateSyntaxError, or raise_exception of a template refusing them
            raise ValueError(f"{where} could not be rendered by the chat template: {type(e).__name__}: {e}") from None

    def beam_search(self, prompts: PromptType | Seq[PromptType], params: BeamSearchParams,
                    use_tqdm: bool = False) -> list[BeamSearchOutput]:
        """Beam search per prompt (HF semantics, early_stopping=True); beams share blocks by
        copy-on-write. Returns one BeamSearchOutput per prompt, sequences best first."""
        prompts = self._as_list(prompts)
        engine = self.llm_engine
        rids: list[str] = []
        try:
            for prompt in prompts:
                rid = f"beam-{next(self._ids)}"
                engine.add_beam_search_request(rid, prompt, params)
                rids.append(rid)
            with heap_frozen_meanwhile(), tqdm(total=len(prompts), desc="Beam search", disable=not use_tqdm) as bar:
                pending = set(rids)
                while pending:
                    self.engine_core.get_output(final_only=True)
                    done = {r for r in pending if not engine.has_request(r)}
                    bar.update(len(done))
                    pending -= done
        except BaseException:
            engine.abort_request(rids)
            for r in rids:
                engine.pop_beam_search_output(r)
            raise
        return [engine.pop_beam_search_output(r) for r in rids]  # type: ignore[misc]
