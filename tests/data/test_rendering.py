"""What the chat template does to a task's rows (``data.tokenize``): tool turns masked and tool calls learnt,
``train_on_inputs``, ``chat_template: auto|always|never`` for prompt rows, and a template's default system
prompt found and replaced by ``system_prompt``."""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from lorafleet.data.tiny_tokenizer import CHATML_TEMPLATE
from lorafleet.data.tokenize import IGNORE_INDEX, default_system_prompt, tokenize_data
from lorafleet.errors import InputError
from lorafleet.specs.data import ChatTemplateUse, DataSpec

SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""SmolLM2-135M-Instruct's chat template, as its tokenizer carries it: a chat without a system turn gets one."""

TOOL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['tool_calls'] is defined %}{% for call in message['tool_calls'] %}"
    "<tool_call>{{ call['function']['name'] }} {{ call['function']['arguments'] | tojson }}</tool_call>"
    "{% endfor %}{% else %}{{ message['content'] }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML that renders an assistant turn's tool calls (as Qwen2.5's does, in fewer words)."""

TOOL_CHAT = [
    {"role": "user", "content": "Weather in Oslo?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}],
    },
    {"role": "tool", "content": "rain, 4 degrees"},
    {"role": "assistant", "content": "Rainy and cold."},
]


def _tokenizer(directory, template):
    tokenizer = AutoTokenizer.from_pretrained(str(directory))
    tokenizer.chat_template = template
    return tokenizer


def _jsonl(tmp_path, rows):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _learnt(tokenizer, example) -> str:
    return tokenizer.decode([t for t, label in zip(example.input_ids, example.labels) if label != IGNORE_INDEX])


def test_tool_output_is_masked_and_tool_calls_are_learnt(tmp_path, tiny_tokenizer_dir):
    tokenizer = _tokenizer(tiny_tokenizer_dir, TOOL_TEMPLATE)
    (example,) = tokenize_data(tokenizer, DataSpec(path=_jsonl(tmp_path, [{"messages": TOOL_CHAT}])))
    rendered = tokenizer.decode(example.input_ids)
    assert "<|im_start|>tool\nrain, 4 degrees<|im_end|>" in rendered  # the template renders the tool turn
    assert _learnt(tokenizer, example) == (
        '<tool_call>weather {"city": "Oslo"}</tool_call><|im_end|>\nRainy and cold.<|im_end|>\n'
    )


def test_a_chat_from_parquet_renders_as_from_jsonl(tmp_path, tiny_tokenizer_dir):
    """Parquet gives every turn every key any turn has (``tool_calls: null`` on a user turn): the same tokens."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tokenizer = _tokenizer(tiny_tokenizer_dir, TOOL_TEMPLATE)
    pq.write_table(pa.Table.from_pylist([{"messages": TOOL_CHAT}]), tmp_path / "chat.parquet")
    assert pq.read_table(tmp_path / "chat.parquet").to_pylist()[0]["messages"][0]["tool_calls"] is None
    from_parquet = tokenize_data(tokenizer, DataSpec(path=str(tmp_path / "chat.parquet")))
    assert from_parquet == tokenize_data(tokenizer, DataSpec(path=_jsonl(tmp_path, [{"messages": TOOL_CHAT}])))


def test_sharegpt_function_calls_and_observations_are_tool_calls_and_tool_turns(tmp_path, tiny_tokenizer_dir):
    tokenizer = _tokenizer(tiny_tokenizer_dir, TOOL_TEMPLATE)
    turns = [
        {"from": "human", "value": "Weather in Oslo?"},
        {"from": "function_call", "value": json.dumps({"name": "weather", "arguments": {"city": "Oslo"}})},
        {"from": "observation", "value": "rain, 4 degrees"},
        {"from": "gpt", "value": "Rainy and cold."},
    ]
    sharegpt = tokenize_data(tokenizer, DataSpec(path=_jsonl(tmp_path, [{"conversations": turns}])))
    (tmp_path / "m").mkdir()
    assert sharegpt == tokenize_data(tokenizer, DataSpec(path=_jsonl(tmp_path / "m", [{"messages": TOOL_CHAT}])))


def test_tool_calls_a_template_cannot_render_are_one_line(tmp_path, tiny_tokenizer_dir):
    tokenizer = _tokenizer(tiny_tokenizer_dir, CHATML_TEMPLATE)
    path = _jsonl(tmp_path, [{"messages": CHAT_ONLY}, {"messages": TOOL_CHAT}])
    with pytest.raises(InputError) as err:
        tokenize_data(tokenizer, DataSpec(path=path))
    assert str(err.value) == f"{path}: row 2: has tool calls, and the tokenizer's chat template does not render them"


CHAT_ONLY = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}]


def test_train_on_inputs_learns_every_token(tmp_path, tiny_tokenizer_dir):
    tokenizer = _tokenizer(tiny_tokenizer_dir, CHATML_TEMPLATE)
    for row in ({"messages": CHAT_ONLY}, {"prompt": "Hi", "response": "Hello."}):
        path = _jsonl(tmp_path, [row])
        (masked,) = tokenize_data(tokenizer, DataSpec(path=path))
        (whole,) = tokenize_data(tokenizer, DataSpec(path=path, train_on_inputs=True))
        assert whole.input_ids == masked.input_ids and whole.labels == whole.input_ids
        assert masked.labels != masked.input_ids  # off by default: the prompt is masked


def test_chat_template_auto_always_never(tmp_path, tiny_tokenizer_dir):
    path = _jsonl(tmp_path, [{"prompt": "Hi", "response": "Hello."}])
    templated = _tokenizer(tiny_tokenizer_dir, CHATML_TEMPLATE)
    plain = _tokenizer(tiny_tokenizer_dir, None)
    (auto,) = tokenize_data(templated, DataSpec(path=path))
    assert (
        templated.decode(auto.input_ids) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n"
    )
    assert tokenize_data(templated, DataSpec(path=path, chat_template=ChatTemplateUse.ALWAYS)) == [auto]
    (never,) = tokenize_data(templated, DataSpec(path=path, chat_template=ChatTemplateUse.NEVER))
    prompt_ids = templated("Hi", add_special_tokens=False)["input_ids"]
    response_ids = templated("Hello.", add_special_tokens=False)["input_ids"] + [templated.eos_token_id]
    assert never.input_ids == tuple(prompt_ids + response_ids)
    assert never.labels == tuple([IGNORE_INDEX] * len(prompt_ids) + response_ids)
    assert tokenize_data(plain, DataSpec(path=path)) == [never]  # auto without a template: not wrapped
    unwrapped = DataSpec(path=path, chat_template=ChatTemplateUse.NEVER, system_prompt="")
    assert tokenize_data(templated, unwrapped) == [never]  # system_prompt is a chat's turn only
    with pytest.raises(InputError) as err:
        tokenize_data(plain, DataSpec(path=path, chat_template=ChatTemplateUse.ALWAYS))
    assert str(err.value) == f"{path}: chat_template: is always, and the tokenizer has no chat template"


def test_a_chat_without_a_template_is_one_line(tmp_path, tiny_tokenizer_dir):
    path = _jsonl(tmp_path, [{"messages": CHAT_ONLY}])
    with pytest.raises(InputError) as err:
        tokenize_data(_tokenizer(tiny_tokenizer_dir, None), DataSpec(path=path))
    assert str(err.value) == f"{path}: row 1: is a chat, and the tokenizer has no chat template to render it"


def test_a_templates_default_system_prompt_is_found_and_can_be_replaced(tmp_path, tiny_tokenizer_dir):
    smol = _tokenizer(tiny_tokenizer_dir, SMOLLM2_TEMPLATE)
    default = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
    assert default_system_prompt(smol) == default
    assert default_system_prompt(_tokenizer(tiny_tokenizer_dir, CHATML_TEMPLATE)) is None
    assert default_system_prompt(_tokenizer(tiny_tokenizer_dir, None)) is None
    path = _jsonl(tmp_path, [{"prompt": "Hi", "response": "Hello."}])
    (injected,) = tokenize_data(smol, DataSpec(path=path))
    assert default in smol.decode(injected.input_ids)
    (empty,) = tokenize_data(smol, DataSpec(path=path, system_prompt=""))
    assert smol.decode(empty.input_ids).startswith("<|im_start|>system\n<|im_end|>\n<|im_start|>user\nHi")
    (own,) = tokenize_data(smol, DataSpec(path=path, system_prompt="Be brief."))
    assert smol.decode(own.input_ids).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert _learnt(smol, own) == "Hello.<|im_end|>\n"  # the system turn is never learnt


def test_the_template_above_is_the_one_smollm2_ships():
    """SMOLLM2_TEMPLATE is the chat template in the demo model's GGUF file (its header's
    ``tokenizer.chat_template``), so the default-system-prompt test is of SmolLM2's own: found in the first bytes,
    without the seconds that parsing the file into a tokenizer takes."""
    from lorafleet.data.model_source import resolve_model_source

    source = resolve_model_source("smollm2-135m")
    with open(f"{source.path}/{source.gguf_file}", "rb") as file:
        header = file.read(8 << 20)  # the metadata (vocabulary, template) precedes the tensors
    assert SMOLLM2_TEMPLATE.encode() in header
