"""Which template a tool run renders with (TRL's rules), and fasttrain's ChatML tool template."""
import copy
from pathlib import Path

import pytest

from support.agent_files import smollm2_tokenizer
from fasttrain.models.tool_template import (CHATML_TOOLS, TemplateError, is_prefix_preserving, renders_tools,
                                            tool_chat_template, tool_suffix_ids)


@pytest.fixture(scope="module")
def tok():
    return smollm2_tokenizer()


def _with(tok, template):
    t = copy.copy(tok)
    t.chat_template = template
    return t


def test_smollm2_gets_the_chatml_tool_template_which_renders_plain_chats_as_its_own(tok):
    assert not renders_tools(tok, tok.chat_template)
    assert tool_chat_template(tok) is CHATML_TOOLS
    assert renders_tools(tok, CHATML_TOOLS) and is_prefix_preserving(tok, CHATML_TOOLS)
    for msgs in ([{"role": "user", "content": "What is 2 + 3?"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]):
        for gen in (True, False):
            assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen) == \
                tok.apply_chat_template(msgs, chat_template=CHATML_TOOLS, tokenize=False, add_generation_prompt=gen)


def test_a_template_that_rewrites_earlier_turns_gets_trls_training_template(tok):
    trl = pytest.importorskip("trl")
    folder = Path(trl.__file__).parent / "chat_templates"
    qwen3 = _with(tok, (folder / "qwen3.jinja").read_text())
    assert renders_tools(qwen3, qwen3.chat_template) and not is_prefix_preserving(qwen3, qwen3.chat_template)
    assert tool_chat_template(qwen3) == (folder / "qwen3_training.jinja").read_text()
    training = _with(tok, (folder / "qwen3_training.jinja").read_text())
    assert tool_chat_template(training) == training.chat_template          # already fine: kept


def test_a_template_without_tools_that_is_not_chatml_is_an_error(tok):
    plain = _with(tok, "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    with pytest.raises(TemplateError, match="cannot render tool calls"):
        tool_chat_template(plain)
    with pytest.raises(TemplateError, match="has none"):
        tool_chat_template(_with(tok, None))


def test_a_suffix_from_a_template_that_is_not_prefix_preserving_is_an_error_never_a_mismatch(tok):
    rewrites = _with(tok, CHATML_TOOLS.replace("{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}",
                                               "{{- '<|im_start|>assistant\\n' + (message['content'] or '') + "
                                               "(' [more]' if not loop.last else '') }}"))
    assert not is_prefix_preserving(rewrites, rewrites.chat_template)
    with pytest.raises(TemplateError, match="not prefix-preserving"):
        tool_suffix_ids(rewrites, [{"role": "tool", "name": "add", "content": "5"}], rewrites.chat_template)
