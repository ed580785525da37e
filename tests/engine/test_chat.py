"""LLM.chat and --chat-template (engine/chat_template.py): conversations render as HF's
apply_chat_template renders them, with the tokenizer's template or one given by path or text;
a missing file or a broken template fails at start-up, a bad message names its field."""
from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from pagedserve.config import EngineConfig
from pagedserve.demo_model import DEMO_MODEL_DIR
from pagedserve.engine.chat_template import apply_chat_template_override, resolve_chat_template
from pagedserve.sampling_params import SamplingParams

from .helpers import hf_greedy, make_llm

# A template unlike the demo model's own (which writes <|role|>\n...): roles as "ROLE: text" lines.
PLAIN = ("{{ bos_token }}{% for m in messages %}{{ m['role'] | upper }}: {{ m['content'] }}\n{% endfor %}"
         "{% if add_generation_prompt %}ASSISTANT:{% endif %}")
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The LORD is"}]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(str(DEMO_MODEL_DIR))


@pytest.fixture(scope="module")
def llm():
    return make_llm(DEMO_MODEL_DIR)


def hf_ids(tok, messages, template=None, **kw):
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=kw.pop("add_generation_prompt", True),
                                   chat_template=template, **kw)
    return tok(text, add_special_tokens=False).input_ids


def test_resolve_reads_a_file_and_takes_text_as_the_template(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text(PLAIN + "\\n kept as written")
    assert resolve_chat_template(str(f)) == PLAIN + "\\n kept as written"
    # Given inline, a typed backslash escape is read as Python reads it (vLLM's rule)...
    assert resolve_chat_template("{{ x }}\\n\\t—") == "{{ x }}\n\t—"
    assert resolve_chat_template(None) is None
    # ...and a value with no template characters that is not a file is a path gone missing.
    with pytest.raises(ValueError, match=r"chat_template: 'no/such\.jinja' looks like a file path"):
        resolve_chat_template("no/such.jinja")


def test_engine_config_refuses_a_missing_template_file_before_loading():
    with pytest.raises(ValueError, match="chat_template: 'missing.jinja'"):
        EngineConfig(model=str(DEMO_MODEL_DIR), chat_template="missing.jinja")


def test_override_refuses_a_template_that_does_not_compile(tok):
    t = AutoTokenizer.from_pretrained(str(DEMO_MODEL_DIR))
    with pytest.raises(ValueError, match="chat_template: not a valid Jinja template: line 1"):
        apply_chat_template_override(t, "{% for m in messages %}{{ m }}")
    assert t.chat_template == tok.chat_template  # left as it was
    # A template that compiles but refuses some conversations is kept: requests meet its errors.
    refusing = "{{ raise_exception('no') if messages[0]['role'] == 'user' else '' }}" + PLAIN
    apply_chat_template_override(t, refusing)
    assert t.chat_template == refusing


def test_chat_renders_as_hf_and_generates_as_generate_does(llm, tok):
    params = SamplingParams(temperature=0.0, max_tokens=8)
    out = llm.chat(CONVERSATION, params, use_tqdm=False)
    assert len(out) == 1
    ids = hf_ids(tok, CONVERSATION)
    assert out[0].prompt_token_ids == ids
    assert list(out[0].outputs[0].token_ids) == hf_greedy(DEMO_MODEL_DIR, ids, 8)


def test_chat_takes_many_conversations_and_a_template_per_call(llm, tok, tmp_path):
    second = [{"role": "user", "content": "And the earth"}]
    f = tmp_path / "plain.jinja"
    f.write_text(PLAIN)
    for template in (None, PLAIN, str(f)):
        out = llm.chat([CONVERSATION, second], SamplingParams(temperature=0.0, max_tokens=2),
                       use_tqdm=False, chat_template=template)
        expected = None if template is None else PLAIN
        assert [o.prompt_token_ids for o in out] == [hf_ids(tok, CONVERSATION, expected), hf_ids(tok, second, expected)]
    assert tok.decode(out[1].prompt_token_ids).endswith("USER: And the earth\nASSISTANT:")
    # A template given as text is used as it is: a backslash and an n stay two characters.
    raw = PLAIN.replace("\n", "\\n")
    out = llm.chat(second, SamplingParams(max_tokens=1), use_tqdm=False, chat_template=raw)
    assert out[0].prompt_token_ids == hf_ids(tok, second, raw)
    assert "And the earth\\nASSISTANT:" in tok.decode(out[0].prompt_token_ids)
    # continue_final_message: the last message is left open for the model to go on.
    partial = [*second, {"role": "assistant", "content": "was without"}]
    out = llm.chat(partial, SamplingParams(max_tokens=1), use_tqdm=False, add_generation_prompt=False,
                   continue_final_message=True)
    assert out[0].prompt_token_ids == hf_ids(tok, partial, add_generation_prompt=False, continue_final_message=True)


def test_chat_uses_the_engines_chat_template():
    llm = make_llm(DEMO_MODEL_DIR, chat_template=PLAIN)
    tok = llm.get_tokenizer()
    assert tok.chat_template == PLAIN
    out = llm.chat(CONVERSATION, SamplingParams(max_tokens=1), use_tqdm=False)
    ref = AutoTokenizer.from_pretrained(str(DEMO_MODEL_DIR))
    assert out[0].prompt_token_ids == hf_ids(ref, CONVERSATION, PLAIN)


@pytest.mark.parametrize("messages, match", [
    ([], r"messages: a conversation needs at least one message"),
    ([{"role": "robot", "content": "x"}], r"messages\[0\]\.role: Input should be"),
    ([{"role": "user", "content": "x"}, {"role": "tool", "content": "42"}],
     r"messages\[1\]\.tool_call_id: a tool message needs the tool_call_id"),
    ([[{"role": "user", "content": "x"}], [{"role": "user"}, {"role": "user", "content": 3}]],
     r"messages\[1\]\[1\]\.content"),
    # the deepest error, not the union's first branch ("content.str: Input should be a valid string")
    ([{"role": "user", "content": [{"type": "video", "video": "x"}]}], r"messages\[0\]\.content\.0\.type: Input should be 'text'"),
    ([{"role": "user", "content": [{"type": "text"}]}], r"messages\[0\]\.content\.0\.text: Field required"),
])
def test_chat_names_the_field_of_a_bad_message(llm, messages, match):
    with pytest.raises(ValueError, match=match):
        llm.chat(messages, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()


@pytest.mark.parametrize("kw, error, match", [
    # each once failed in a TypeError naming nothing (dict([1, 2]), "got multiple values for
    # argument"), a jinja exception, or ran with "no" taken as True
    (dict(chat_template_kwargs=[1, 2]), TypeError, "chat_template_kwargs must be a dict"),
    (dict(chat_template_kwargs={"add_generation_prompt": False}), ValueError,
     "chat_template_kwargs may not set add_generation_prompt"),
    (dict(chat_template_kwargs={"tokenize": True, "tools": []}), ValueError, "chat_template_kwargs may not set tokenize, tools"),
    (dict(add_generation_prompt="no"), TypeError, "add_generation_prompt must be a bool"),
    (dict(add_generation_prompt=False, continue_final_message="yes"), TypeError, "continue_final_message must be a bool"),
    (dict(tools="x"), TypeError, "tools must be a list of dicts"),
    (dict(chat_template="{% if %}"), ValueError, "messages could not be rendered by the chat template: TemplateSyntax"),
    (dict(chat_template="{{ raise_exception('no system') }}"), ValueError, "rendered by the chat template.*no system"),
])
def test_chat_argument_errors_name_the_argument(llm, kw, error, match):
    sp = SamplingParams(temperature=0, max_tokens=3)
    before = llm.chat(CONVERSATION, sp, use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(error, match=match):
        llm.chat(CONVERSATION, sp, use_tqdm=False, **kw)
    assert llm.chat(CONVERSATION, sp, use_tqdm=False)[0].outputs[0].token_ids == before


@pytest.mark.parametrize("messages, match", [
    ("hello", "messages must be a list of message dicts"),  # was read as five one-letter messages
    (None, "messages must be a list of message dicts"),
])
def test_chat_refuses_messages_that_are_no_list(llm, messages, match):
    with pytest.raises(TypeError, match=match):
        llm.chat(messages, use_tqdm=False)


def test_chat_refuses_continue_final_message_with_a_generation_prompt(llm):
    with pytest.raises(ValueError, match="continue_final_message needs add_generation_prompt=False"):
        llm.chat(CONVERSATION, use_tqdm=False, continue_final_message=True)


def test_chat_content_format_openai_passes_parts_to_the_template(llm, tok):
    """LLM.chat(chat_template_content_format=...) as vLLM's: openai hands the template a list of
    parts (here looped over), string joins them; auto picks openai for a template that loops."""
    parts = ("{% for m in messages %}{{ m['role'] }}:{% for p in m['content'] %}<{{ p['text'] }}>{% endfor %}\n"
             "{% endfor %}")
    conv = [{"role": "user", "content": [{"type": "text", "text": "The LORD"}, {"type": "text", "text": "is"}]}]
    sp = SamplingParams(temperature=0, max_tokens=1)
    for fmt in ("openai", None):  # None: the engine's auto
        out = llm.chat(conv, sp, use_tqdm=False, chat_template=parts, chat_template_content_format=fmt)[0]
        assert out.prompt_token_ids == hf_ids(tok, conv, parts)
    joined = llm.chat(conv, sp, use_tqdm=False, chat_template=PLAIN, chat_template_content_format="string")[0]
    assert joined.prompt_token_ids == hf_ids(tok, [{"role": "user", "content": "The LORD\nis"}], PLAIN)
    with pytest.raises(ValueError, match="chat_template_content_format must be one of"):
        llm.chat(conv, sp, use_tqdm=False, chat_template_content_format="html")
    with pytest.raises(ValueError, match="chat_template_content_format must be one of"):
        EngineConfig(chat_template_content_format="html")
