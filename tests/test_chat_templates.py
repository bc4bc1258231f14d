"""The chat template's tool support, found by rendering it: templates written by hand the way each model
family's renders tools and tool calls (Qwen 2.5 / Qwen3: hermes, Llama 3.1: JSON, Mistral: [TOOL_CALLS],
Qwen3-Coder: XML, Llama 3.2 pythonic) are told apart by what they render, not by a substring of
their source; --chat-template takes a file or the template itself."""
from __future__ import annotations

from pathlib import Path

import pytest

from augury.server.templates import TemplateInfo, inspect_template, load_chat_template

CHATML = ("{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
          "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

QWEN3 = """{%- if tools %}<|im_start|>system
# Tools

You may call one or more functions to assist with the user query.

<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags.<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{{ m.content }}
{%- for tc in m.tool_calls %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}
{%- endif %}"""

LLAMA31 = """{{- bos_token }}
{%- if tools %}<|start_header_id|>system<|end_header_id|>

Environment: ipython

Given the following functions, respond with a JSON for a function call with its proper arguments.
{% for t in tools %}{{ t | tojson }}
{% endfor %}<|eot_id|>
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{% for tc in m.tool_calls %}{"name": "{{ tc.function.name }}", "parameters": {{ tc.function.arguments | tojson }}}{% endfor %}<|eot_id|>
{%- elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

MISTRAL = """{{- bos_token }}
{%- for m in messages %}
{%- if m.role == 'user' %}
{%- if tools and loop.last %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST]{{ m.content }}[/INST]
{%- elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS][
{%- for tc in m.tool_calls %}
{%- if tc.id is not string or tc.id | length != 9 %}{{ raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}{% endif %}
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}, "id": "{{ tc.id }}"}{% if not loop.last %}, {% endif %}
{%- endfor %}]</s>
{%- elif m.role == 'tool' %}[TOOL_RESULTS]{"content": {{ m.content | tojson }}, "call_id": "{{ m.tool_call_id }}"}[/TOOL_RESULTS]
{%- else %}{{ m.content }}</s>
{%- endif %}
{%- endfor %}"""

QWEN3_CODER = """{%- if tools %}<|im_start|>system
# Tools

You have access to the following functions:

<tools>
{%- for tool in tools %}
<function>
<name>{{ tool.function.name }}</name>
</function>
{%- endfor %}
</tools>

If you choose to call a function ONLY reply in the following format with NO suffix:

<tool_call>
<function=example_function_name>
<parameter=example_parameter_1>
value_1
</parameter>
</function>
</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant
{{ m.content }}
{%- for tc in m.tool_calls %}
<tool_call>
<function={{ tc.function.name }}>
{% for k, v in tc.function.arguments.items() %}<parameter={{ k }}>
{{ v }}
</parameter>
{% endfor %}</function>
</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

PYTHONIC = """{{- bos_token }}
{%- if tools %}<|start_header_id|>system<|end_header_id|>

You can call these functions, writing [func_name1(params_name1=params_value1), func_name2(params)]:
{{ tools | tojson }}<|eot_id|>
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'assistant' and m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

[{% for tc in m.tool_calls %}{{ tc.function.name }}({% for k, v in tc.function.arguments.items() %}{{ k }}={{ v | tojson }}{% if not loop.last %}, {% endif %}{% endfor %}){% if not loop.last %}, {% endif %}{% endfor %}]<|eot_id|>
{%- elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

# its source says "tools" (a comment), but it renders none: the substring test called this native
MENTIONS_TOOLS = "{# tools are not supported by this model #}" + CHATML


def tokenizer(template: str | None):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
                                  bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tok.chat_template = template
    return tok


@pytest.mark.parametrize("template,expected", [
    (QWEN3, TemplateInfo(True, True, "hermes")),
    (LLAMA31, TemplateInfo(True, True, "llama3_json")),
    (MISTRAL, TemplateInfo(True, True, "mistral")),
    (QWEN3_CODER, TemplateInfo(True, True, "qwen3_coder")),
    (PYTHONIC, TemplateInfo(True, True, "pythonic")),
    (CHATML, TemplateInfo(False, False, None)),
    (MENTIONS_TOOLS, TemplateInfo(False, False, None)),
    (None, TemplateInfo(False, False, None)),
])
def test_tool_support_is_found_by_rendering(template: str | None, expected: TemplateInfo) -> None:
    assert inspect_template(tokenizer(template)) == expected


def test_a_template_that_raises_on_calls_renders_none() -> None:
    raising = ("{%- for m in messages %}{% if m.tool_calls %}{{ raise_exception('no tools here') }}{% endif %}"
               "{{ m.content }}{% endfor %}")
    assert inspect_template(tokenizer(raising)) == TemplateInfo(False, False, None)


def test_chat_template_from_a_file_or_a_string(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text(QWEN3, encoding="utf-8")
    assert load_chat_template(str(path)) == QWEN3
    assert load_chat_template(CHATML) == CHATML
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not parse"):
        load_chat_template("{% for m in messages %}{{ m.content }}")


def test_the_prompt_end_and_which_markers_are_special_tokens() -> None:
    """serving._answer_start: the prompt's last characters (where reasoning starts) and whether a tool
    format's markers are special tokens, which the text leaves out unless the request keeps them."""
    from augury.server.serving import _answer_start

    tok = tokenizer(MISTRAL)
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    tok.add_tokens(["<think>", "</think>"])
    ids = tok.encode("<think>", add_special_tokens=False)
    tail, keep = _answer_start(tok, ids, ("[TOOL_CALLS]", "[ARGS]"))
    assert tail.endswith("<think>") and keep
    assert _answer_start(tok, ids, ("<|python_tag|>",))[1] is False
    assert _answer_start(tok, ids, ())[1] is False
