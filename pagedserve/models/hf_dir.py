"""A local HF model directory, checked without torch or transformers: its config.json, the
user's overrides of it (--hf-overrides), its RoPE parameters, its context limit and its
safetensors files. `pagedserve serve` runs these before any process starts (engine/preflight.py);
the loader (loader.py) runs them again and then builds the model.
"""
from __future__ import annotations

import glob
import json
import os

PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
SAFETENSORS_INDEX = "model.safetensors.index.json"


def read_config_json(model_dir: str | os.PathLike) -> dict:
    """config.json of a local directory as a dict; a ValueError of one line naming the path otherwise."""
    model_dir = os.fspath(model_dir)
    if not os.path.isdir(model_dir):
        raise ValueError(f"model: {model_dir!r} is not a local directory (pagedserve loads local HF directories; "
                         "there is no model-hub download)")
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"model: no config.json in {model_dir!r}")
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"model: {path} is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"model: {path} must hold a JSON object, got {type(raw).__name__}")
    return raw


ROPE_KEYS = ("rope_scaling", "rope_parameters")  # transformers 4's name, and 5's
ROPE_FIELDS = ("rope_theta",)  # a config field in transformers 4, inside rope_parameters in 5


def per_layer_type(params: dict) -> bool:
    """Whether RoPE parameters hold one dict per layer type (Gemma 3's) instead of one for all."""
    return "rope_type" not in params and "rope_theta" not in params and len(params) > 0 and \
        all(isinstance(v, dict) for v in params.values())


def rope_parameters(config, layer_type: str | None = None) -> dict:
    """RoPE params from an HF config (or a namespace of config.json): transformers 5
    `rope_parameters`, or 4.x rope_scaling + rope_theta. YaRN's original_max_position_embeddings
    left out is max_position_embeddings, and its `factor` left out (None) the one over the other,
    as HF derives them; LongRoPE's likewise. layer_type: which of a per-layer-type set (Gemma 3's)."""
    params = getattr(config, "rope_parameters", None)
    # A transformers config object's rope_parameters were standardized by the installed transformers.
    standardized = bool(params) and any(c.__module__.startswith("transformers.") for c in type(config).__mro__)
    if params:
        params = dict(params)
        # Some configs hold one dict per layer type (Gemma 3): that of layer_type, else the global
        # one (full_attention's), else the first.
        if per_layer_type(params):
            params = dict(params.get(layer_type) or params.get("full_attention") or next(iter(params.values())))
    else:
        params = dict(getattr(config, "rope_scaling", None) or {})
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    params.setdefault("rope_type", params.get("type", "default"))
    if params["rope_type"] == "su":  # LongRoPE's first name (Phi-3's early configs)
        params["rope_type"] = "longrope"
    if params["rope_type"] == "dynamic":  # the length its factor scales: the config's limit, as HF's
        params["original_max_position_embeddings"] = config.max_position_embeddings
    if params["rope_type"] in ("yarn", "longrope"):
        # Where a config has both lengths, which wins changed between transformers versions (5.17:
        # the RoPE dict's; 5.25: the config field, Phi-3's): a standardized object keeps what the
        # installed one chose; config.json read raw (preflight) takes 5.25's order. Then
        # max_position_embeddings.
        own = params.get("original_max_position_embeddings")
        field = getattr(config, "original_max_position_embeddings", None)
        params["original_max_position_embeddings"] = ((own or field) if standardized else (field or own)) \
            or config.max_position_embeddings
        if params.get("factor") is None:
            params["factor"] = config.max_position_embeddings / params["original_max_position_embeddings"]
    return params


def apply_hf_overrides(config, overrides: dict | None, strict: bool = True):
    """config with --hf-overrides applied, as vLLM applies them: each key's value replaces the
    config's, except a RoPE dict (rope_scaling or rope_parameters, either name), which is merged
    into the model's own RoPE parameters, so that {"rope_scaling": {"rope_type": "yarn", ...}}
    keeps the checkpoint's rope_theta (transformers 5 takes a bare rope_scaling as the whole of
    them and loses it), and a top-level rope_theta joins them (a field in transformers 4 only). strict: a key the config lacks is a one-line ValueError (a typo would
    otherwise change nothing, silently); the preflight's namespace of config.json is not strict,
    as the file omits fields that take their class defaults. Sets attributes in place; returns
    config."""
    if not overrides:
        return config
    rope = {}
    for key, value in overrides.items():
        if key in ROPE_KEYS:
            rope.update(value)
            continue
        if key in ROPE_FIELDS:
            rope[key] = value
            continue
        if strict and not hasattr(config, key):
            raise ValueError(f"hf_overrides: the model's config has no field {key!r}")
        setattr(config, key, value)
    if rope:
        merged = {**rope_parameters(config), **rope}
        if "type" in rope and "rope_type" not in rope:  # the old spelling of the key
            merged["rope_type"] = rope["type"]
        if hasattr(config, "rope_parameters"):  # transformers 5 (its configs always have it)
            config.rope_parameters = merged
        else:
            config.rope_scaling, config.rope_theta = merged, merged["rope_theta"]
    return config


# Multimodal architectures served as their text decoder (text prompts only; their vision weights are
# not loaded): the config becomes its text_config, under the multimodal architecture's name.
TEXT_DECODER_VIEWS = ("Gemma3ForConditionalGeneration",)


def text_decoder_view(config):
    """config, or for a TEXT_DECODER_VIEWS architecture its text_config, named by that
    architecture (models/registry.py maps it to the text decoder) and with the checkpoint's dtype."""
    archs = getattr(config, "architectures", None) or []
    if not archs or archs[0] not in TEXT_DECODER_VIEWS:
        return config
    text = config.text_config
    text.architectures = [archs[0]]
    for key in ("dtype", "torch_dtype"):
        if getattr(text, key, None) is None and getattr(config, key, None) is not None:
            setattr(text, key, getattr(config, key))
    return text


def get_max_model_len(hf_config, disable_sliding_window: bool = False) -> int:
    """The longest context the model supports: its position limit, scaled as vLLM scales it for
    RoPE scaling (YaRN: original_max_position_embeddings x factor; linear and dynamic: the limit x factor;
    llama3's configs state their scaled limit already). A sliding window does not limit it: the
    layers that have one attend to their last positions only (sliding_windows); unless
    disable_sliding_window (vLLM's flag), which caps it at the smallest window, so none binds."""
    limit = _position_limit(hf_config)
    if disable_sliding_window:
        limit = min([limit] + [w for w in sliding_windows(hf_config, limit) if w])
    return limit


def _position_limit(hf_config) -> int:
    limit = None
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length"):
        value = getattr(hf_config, key, None)
        if isinstance(value, int) and value > 0:
            limit = value
            break
    if limit is None:
        raise ValueError("cannot find the model's maximum length in its config; pass max_model_len")
    rope = rope_parameters(hf_config)
    if per_layer_type(getattr(hf_config, "rope_parameters", None) or {}):
        return limit  # Gemma 3: its limit is already the scaled one (vLLM reads it so too)
    factor = rope.get("factor")
    if rope["rope_type"] == "yarn":
        limit = int(rope.get("original_max_position_embeddings", limit) * factor)
    elif rope["rope_type"] in ("linear", "dynamic") and factor:
        limit = int(limit * factor)
    return limit


def sliding_windows(hf_config, max_model_len: int) -> list[int]:
    """Each layer's sliding window (0: full attention), as transformers builds the layers' masks:
    config.layer_types where it has them ("sliding_attention" layers get config.sliding_window:
    Qwen2's max_window_layers, alternating models), else config.sliding_window for every layer
    (Mistral, Phi-3), unless use_sliding_window is false. A window of max_model_len or more never
    binds: 0, so those layers run the full-attention kernels. Layer kinds other than these two
    (chunked or linear attention) are refused, window or not."""
    layers = hf_config.num_hidden_layers
    types = getattr(hf_config, "layer_types", None)
    unknown = sorted(set(types or ()) - {"sliding_attention", "full_attention"})
    if unknown:
        raise ValueError(f"config.layer_types: {unknown} not supported (full_attention and sliding_attention are)")
    window = getattr(hf_config, "sliding_window", None)
    if not isinstance(window, int) or window <= 0 or getattr(hf_config, "use_sliding_window", True) is False:
        return [0] * layers
    window = window if window < max_model_len else 0
    if types is None:
        return [window] * layers
    if len(types) != layers:
        raise ValueError(f"config.layer_types has {len(types)} entries for {layers} layers")
    return [window if t == "sliding_attention" else 0 for t in types]


def safetensors_files(model_dir: str | os.PathLike) -> list[str]:
    """The checkpoint's safetensors files (from the index when sharded); refuses pickled checkpoints."""
    model_dir = os.fspath(model_dir)
    index = os.path.join(model_dir, SAFETENSORS_INDEX)
    if os.path.isfile(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        files = [os.path.join(model_dir, n) for n in names]
        missing = [f for f in files if not os.path.isfile(f)]
        if missing:
            raise ValueError(f"{SAFETENSORS_INDEX} lists missing shard(s): {[os.path.basename(m) for m in missing]}")
        return files
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if files:
        return files
    pickled = sorted(os.path.basename(p) for pat in PICKLE_PATTERNS for p in glob.glob(os.path.join(model_dir, pat)))
    if pickled:
        raise ValueError(f"model: {model_dir!r} holds only pickled checkpoint(s) {pickled}; pagedserve never loads "
                         "pickles (they can run arbitrary code). Convert them to safetensors, e.g. "
                         "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)")
    raise ValueError(f"model: no *.safetensors weights in {model_dir!r} (for random weights: --load-format dummy on the "
                     "command line, load_format='dummy' in LLM(...))")
