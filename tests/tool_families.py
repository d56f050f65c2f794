"""Tiny random-weight models of each tool-calling family, with that family's chat template, tokens and replies.

A :class:`Family` is what a test needs to drive one family's tool-call format without the family's real weights:
a chat template of the family's shape (where tools are listed, how an assistant's earlier calls and the tools'
results are written, the generation prompt, thinking), its added tokens (control tokens that decoding skips, and
the plain ones that show in text), its end-of-turn tokens, and ``replies``: the exact text the family writes after
the generation prompt for each case of ``EXPECTED``. The templates are written for these tests after the families'
published templates (vLLM's ``examples/tool_chat_template_*.jinja``, the checkpoints' own, OpenAI's harmony
format); the replies after what the families' parsers accept.

``replies`` stop before the token the generation stops on (``eos`` or one of ``stops``), except harmony's, whose
``<|call|>`` and ``<|return|>`` are part of the format and written. A family whose generation prompt opens its
thinking block (DeepSeek R1) has replies that start inside it. ``make_family(name, out)`` writes the model
directory (weights through transformers' own classes, from ``arch_models``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from arch_families import ARCHS_2026
from arch_models import _DENSE_GPU, _DENSE_TINY, ARCHS, QWEN3, Arch, make_arch, template_file

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "The city's name."},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "description": "Temperature unit."},
                },
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Get the current time in a time zone.",
            "parameters": {
                "type": "object",
                "properties": {"timezone": {"type": "string", "description": "An IANA time zone."}},
                "required": ["timezone"],
            },
        },
    },
]

Call = tuple[str, dict[str, Any]]
ONE: list[Call] = [("get_weather", {"city": "Paris"})]
TWO: list[Call] = [("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "Europe/Paris"})]
THOUGHT = "The user wants the weather in Paris, so I call get_weather."
PREFACE = "Let me check the weather."
ANSWER = "It is sunny in Paris."

EXPECTED: dict[str, list[Call]] = {
    "one": ONE,
    "two": TWO,
    "content_then_call": ONE,
    "think_then_call": ONE,
    "python_tag": ONE,
    "answer": [],
    "think_then_answer": [],
}
"""The calls (name, arguments) each reply holds."""

EXPECTED_TEXT: dict[str, tuple[str | None, str | None]] = {
    "one": (None, None),
    "two": (None, None),
    "content_then_call": (None, PREFACE),
    "think_then_call": (THOUGHT, None),
    "python_tag": (None, None),
    "answer": (None, ANSWER),
    "think_then_answer": (THOUGHT, ANSWER),
}
"""(reasoning, content) each reply holds, stripped of surrounding whitespace; None for none."""

RESULT = '{"temperature": 21, "condition": "sunny"}'


@dataclass(frozen=True)
class Family:
    """One family's tool-call shape: template, tokens and the exact replies it writes (see the module docstring)."""

    name: str
    arch: str
    tool_format: str
    template: str
    specials: tuple[str, ...]
    plain: tuple[str, ...]
    eos: str
    bos: str | None
    thinking: tuple[str, str] | None
    replies: dict[str, str]
    stops: tuple[str, ...] = ()
    """Other tokens that end a turn (listed after ``eos`` in generation_config's eos_token_id)."""
    call_id: str = "call_w1"
    """The call id ``history`` uses (Mistral's templates accept only 9 alphanumeric characters)."""
    thinks_first: bool = False
    """The generation prompt opens the thinking block: every reply starts inside it (DeepSeek R1, Qwen3.5)."""


def _args(a: dict[str, Any]) -> str:
    return json.dumps(a)


# ---------------------------------------------------------------- Hermes (Qwen3)

_HERMES_CHATML = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
_HERMES_PLAIN = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")


def _hermes(calls: list[Call]) -> str:
    return "\n".join(f'<tool_call>\n{{"name": "{n}", "arguments": {_args(a)}}}\n</tool_call>' for n, a in calls)


HERMES = Family(
    "hermes",
    "qwen3",
    "hermes",
    QWEN3,
    _HERMES_CHATML,
    _HERMES_PLAIN,
    "<|im_end|>",
    None,
    ("<think>", "</think>"),
    {
        "one": _hermes(ONE),
        "two": _hermes(TWO),
        "content_then_call": f"{PREFACE}\n\n{_hermes(ONE)}",
        "think_then_call": f"<think>\n{THOUGHT}\n</think>\n\n{_hermes(ONE)}",
        "answer": ANSWER,
        "think_then_answer": f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}",
    },
    stops=("<|endoftext|>",),
)

# ---------------------------------------------------------------- Qwen3-Coder (XML calls)

# Tools listed in the system turn as XML (<function><name>..<parameters><parameter>..), earlier calls written in the
# same XML they are made in, consecutive tool results gathered in one user turn of <tool_response> blocks.
QWEN3_CODER = (
    "{% set sys = messages[0]['content'] if messages[0]['role'] == 'system' else none %}"
    "{% if sys is not none or tools %}<|im_start|>system\n"
    "{{ sys if sys is not none else 'You are a helpful assistant.' }}{% if tools %}"
    "{{ '\\n\\n# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}"
    "{% for t in tools %}{% set f = t['function'] if t['function'] is defined else t %}"
    "{{ '\\n<function>\\n<name>' ~ f['name'] ~ '</name>' }}"
    "{% if f['description'] is defined %}{{ '\\n<description>' ~ f['description'] ~ '</description>' }}{% endif %}"
    "{{ '\\n<parameters>' }}{% for k, p in (f['parameters']['properties'] or {}) | items %}"
    "{{ '\\n<parameter>\\n<name>' ~ k ~ '</name>\\n<type>' ~ p['type'] ~ '</type>' }}"
    "{% if p['description'] is defined %}{{ '\\n<description>' ~ p['description'] ~ '</description>' }}{% endif %}"
    "{% if p['enum'] is defined %}{{ '\\n<enum>' ~ (p['enum'] | tojson) ~ '</enum>' }}{% endif %}"
    "{{ '\\n</parameter>' }}{% endfor %}"
    "{% if f['parameters']['required'] is defined %}"
    "{{ '\\n<required>' ~ (f['parameters']['required'] | tojson) ~ '</required>' }}{% endif %}"
    "{{ '\\n</parameters>\\n</function>' }}{% endfor %}"
    "{{ '\\n</tools>\\n\\nIf you choose to call a function ONLY reply in the following format with NO suffix:\\n\\n"
    "<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n"
    "</function>\\n</tool_call>' }}{% endif %}<|im_end|>\n"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' and loop.first %}"
    "{% elif m['role'] == 'assistant' and m.get('tool_calls') %}<|im_start|>assistant"
    "{% if m['content'] %}{{ '\\n' ~ (m['content'] | trim) }}{% endif %}"
    "{% for c in m['tool_calls'] %}{{ '\\n<tool_call>\\n<function=' ~ c['function']['name'] ~ '>\\n' }}"
    "{% for k, v in c['function']['arguments'] | items %}{{ '<parameter=' ~ k ~ '>\\n' }}"
    "{{ v if v is string else (v | tojson) }}{{ '\\n</parameter>\\n' }}{% endfor %}"
    "{{ '</function>\\n</tool_call>' }}{% endfor %}<|im_end|>\n"
    "{% elif m['role'] == 'tool' %}"
    "{% if loop.first or loop.previtem['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n<tool_response>\\n' ~ m['content'] ~ '\\n</tool_response>' }}"
    "{% if loop.last or loop.nextitem['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _xml(calls: list[Call]) -> str:
    def params(a: dict[str, Any]) -> str:
        return "".join(
            f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n" for k, v in a.items()
        )

    return "\n".join(f"<tool_call>\n<function={n}>\n{params(a)}</function>\n</tool_call>" for n, a in calls)


QWEN3_CODER_FAMILY = Family(
    "qwen3_coder",
    "qwen3",
    "qwen3_coder",
    QWEN3_CODER,
    _HERMES_CHATML,
    _HERMES_PLAIN,
    "<|im_end|>",
    None,
    None,
    {
        "one": _xml(ONE),
        "two": _xml(TWO),
        "content_then_call": f"{PREFACE}\n{_xml(ONE)}",
        "answer": ANSWER,
    },
    stops=("<|endoftext|>",),
)

# ---------------------------------------------------------------- Llama 3.1 / 3.2 / 3.3 JSON

# "Environment: ipython" in the system turn when tools are given, the tools' JSON in the first user turn, an earlier
# call written as the JSON object it was made in (one a turn: Llama's template refuses more), results under the
# ipython role.
LLAMA3_JSON = (
    "{{ bos_token }}"
    "{% if date_string is not defined %}{% set date_string = strftime_now('%d %b %Y') %}{% endif %}"
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] | trim %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
    "<|start_header_id|>system<|end_header_id|>\n\n"
    "{% if tools %}{{ 'Environment: ipython\\n' }}{% endif %}"
    "{{ 'Cutting Knowledge Date: December 2023\\nToday Date: ' ~ date_string ~ '\\n\\n' ~ system }}<|eot_id|>"
    "{% if tools %}"
    "{% if not messages or messages[0]['role'] != 'user' %}"
    "{{ raise_exception('Cannot put tools in the first user message when there is no first user message!') }}"
    "{% endif %}<|start_header_id|>user<|end_header_id|>\n\n"
    "{{ 'Given the following functions, please respond with a JSON for a function call with its proper arguments "
    'that best answers the given prompt.\\n\\nRespond in the format {"name": function name, "parameters": '
    "dictionary of argument name and its value}. Do not use variables.\\n\\n' }}"
    "{% for t in tools %}{{ t | tojson(indent=4) }}{{ '\\n\\n' }}{% endfor %}"
    "{{ messages[0]['content'] | trim }}<|eot_id|>{% set messages = messages[1:] %}{% endif %}"
    "{% for m in messages %}"
    "{% if m.get('tool_calls') %}"
    "{% if m['tool_calls'] | length > 1 %}"
    "{{ raise_exception('This model only supports single tool-calls at once!') }}{% endif %}"
    "{% set f = m['tool_calls'][0]['function'] %}<|start_header_id|>assistant<|end_header_id|>\n\n"
    "{{ '{\"name\": \"' ~ f['name'] ~ '\", \"parameters\": ' ~ (f['arguments'] | tojson) ~ '}' }}<|eot_id|>"
    "{% elif m['role'] in ['tool', 'ipython'] %}<|start_header_id|>ipython<|end_header_id|>\n\n"
    "{{ m['content'] if m['content'] is string else (m['content'] | tojson) }}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def _llama_json(calls: list[Call]) -> str:
    return "; ".join(f'{{"name": "{n}", "parameters": {_args(a)}}}' for n, a in calls)


LLAMA3_FAMILY = Family(
    "llama3",
    "llama3",
    "llama3_json",
    LLAMA3_JSON,
    (
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<|python_tag|>",
    ),
    (),
    "<|eot_id|>",
    "<|begin_of_text|>",
    None,
    {
        "one": _llama_json(ONE),
        "two": _llama_json(TWO),
        "python_tag": "<|python_tag|>" + _llama_json(ONE),
        "answer": ANSWER,
    },
    stops=("<|eom_id|>", "<|end_of_text|>"),
)

# ---------------------------------------------------------------- Llama 4 (pythonic)

# Llama 4's turn markers; the tools' JSON in the system turn; earlier calls written as the pythonic list they were
# made in; results under the ipython role.
LLAMA4_PYTHONIC = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] | trim %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = '' %}{% endif %}"
    "{% if system or tools %}<|header_start|>system<|header_end|>\n\n{{ system }}"
    "{% if tools %}{{ ('\\n\\n' if system else '') ~ 'Here is a list of functions in JSON format that you can "
    "invoke. Use exact format: [func_name1(param1=value1, param2=value2), func_name2(...)]\\n' }}"
    "{{ tools | tojson(indent=4) }}{{ '\\n' }}{% endif %}<|eot|>{% endif %}"
    "{% for m in messages %}"
    "{% if m.get('tool_calls') %}<|header_start|>assistant<|header_end|>\n\n{{ m['content'] or '' }}["
    "{% for c in m['tool_calls'] %}{{ c['function']['name'] }}("
    "{% for k, v in c['function']['arguments'] | items %}{{ k }}={{ v | tojson }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}){% if not loop.last %}, {% endif %}{% endfor %}]<|eot|>"
    "{% elif m['role'] in ['tool', 'ipython'] %}<|header_start|>ipython<|header_end|>\n\n"
    "{{ m['content'] | tojson }}<|eot|>"
    "{% else %}<|header_start|>{{ m['role'] }}<|header_end|>\n\n{{ m['content'] }}<|eot|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|header_start|>assistant<|header_end|>\n\n{% endif %}"
)


def _pythonic(calls: list[Call]) -> str:
    def args(a: dict[str, Any]) -> str:
        return ", ".join(f"{k}={json.dumps(v)}" for k, v in a.items())

    return "[" + ", ".join(f"{n}({args(a)})" for n, a in calls) + "]"


LLAMA4_FAMILY = Family(
    "llama4_pythonic",
    "llama3",
    "pythonic",
    LLAMA4_PYTHONIC,
    (
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|header_start|>",
        "<|header_end|>",
        "<|eot|>",
        "<|eom|>",
        "<|python_start|>",
        "<|python_end|>",
    ),
    (),
    "<|eot|>",
    "<|begin_of_text|>",
    None,
    {"one": _pythonic(ONE), "two": _pythonic(TWO), "answer": ANSWER},
    stops=("<|eom|>", "<|end_of_text|>"),
)

# ---------------------------------------------------------------- Mistral (v3 tokenizer: JSON list)

# The tools in [AVAILABLE_TOOLS] just before the last user turn, the system text inside the last [INST]; earlier
# calls as [TOOL_CALLS] JSON lists carrying their 9-character ids, results in [TOOL_RESULTS] with the call's id.
_MISTRAL_ID_CHECK = (
    "{% if not (@ is string and @ | length == 9 and @.isalnum()) %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{% endif %}"
)
MISTRAL_V3 = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = none %}{% endif %}"
    "{% set users = messages | selectattr('role', 'equalto', 'user') | list %}"
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}"
    "{% if tools and m is sameas users[-1] %}[AVAILABLE_TOOLS] [{% for t in tools %}"
    "{{ '{\"type\": \"function\", \"function\": ' ~ (t['function'] | tojson) ~ '}' }}"
    "{% if not loop.last %}, {% endif %}{% endfor %}][/AVAILABLE_TOOLS]{% endif %}"
    "{% if m is sameas users[-1] and system is not none %}[INST] {{ system ~ '\\n\\n' ~ m['content'] }}[/INST]"
    "{% else %}[INST] {{ m['content'] }}[/INST]{% endif %}"
    "{% elif m['role'] == 'assistant' and m.get('tool_calls') %}[TOOL_CALLS] ["
    "{% for c in m['tool_calls'] %}" + _MISTRAL_ID_CHECK.replace("@", "c['id']") + ""
    "{{ '{\"name\": \"' ~ c['function']['name'] ~ '\", \"arguments\": ' ~ (c['function']['arguments'] | tojson)"
    " ~ ', \"id\": \"' ~ c['id'] ~ '\"}' }}{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}"
    "{% elif m['role'] == 'assistant' %}{{ ' ' ~ (m['content'] | trim) ~ eos_token }}"
    "{% elif m['role'] == 'tool' %}" + _MISTRAL_ID_CHECK.replace("@", "m['tool_call_id']") + ""
    "{{ '[TOOL_RESULTS] {\"content\": ' ~ (m['content'] | string) ~ ', \"call_id\": \"' ~ m['tool_call_id']"
    " ~ '\"}[/TOOL_RESULTS]' }}"
    "{% else %}{{ raise_exception('Only user, assistant and tool roles are supported after the system message!') }}"
    "{% endif %}{% endfor %}"
)


def _mistral_list(calls: list[Call]) -> str:
    return "[" + ", ".join(f'{{"name": "{n}", "arguments": {_args(a)}}}' for n, a in calls) + "]"


MISTRAL_TOKENS = (
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[TOOL_CALLS]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
)
"""The control tokens of Mistral's tokenizers with tools (v3 on); later versions add their own after these."""

MISTRAL_FAMILY = Family(
    "mistral",
    "mistral",
    "mistral",
    MISTRAL_V3,
    MISTRAL_TOKENS,
    (),
    "</s>",
    "<s>",
    None,
    {
        "one": "[TOOL_CALLS] " + _mistral_list(ONE),
        "two": "[TOOL_CALLS] " + _mistral_list(TWO),
        "content_then_call": f"{PREFACE}[TOOL_CALLS] {_mistral_list(ONE)}",
        "answer": ANSWER,
    },
    call_id="a1B2c3D4e",
)

# ---------------------------------------------------------------- Magistral / Mistral Small 3.2 (NAME[ARGS]{...})

# [SYSTEM_PROMPT] first, the tools in [AVAILABLE_TOOLS] before the last user turn, earlier calls as
# [TOOL_CALLS]NAME[ARGS]{...} (one marker a call), results in [TOOL_RESULTS]...[/TOOL_RESULTS]; an earlier turn's
# [THINK] block is dropped.
MAGISTRAL = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}[SYSTEM_PROMPT]{{ messages[0]['content'] }}[/SYSTEM_PROMPT]"
    "{% set messages = messages[1:] %}{% endif %}"
    "{% set users = messages | selectattr('role', 'equalto', 'user') | list %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}"
    "{% if tools and m is sameas users[-1] %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "[INST]{{ m['content'] }}[/INST]"
    "{% elif m['role'] == 'assistant' %}{{ (m['content'] or '').split('[/THINK]')[-1] }}"
    "{% for c in m.get('tool_calls') or [] %}[TOOL_CALLS]{{ c['function']['name'] }}[ARGS]"
    "{{ c['function']['arguments'] | tojson }}{% endfor %}{{ eos_token }}"
    "{% elif m['role'] == 'tool' %}[TOOL_RESULTS]{{ m['content'] }}[/TOOL_RESULTS]"
    "{% else %}{{ raise_exception('Only user, assistant and tool roles are supported after the system message!') }}"
    "{% endif %}{% endfor %}"
)


def _v11(calls: list[Call]) -> str:
    return "".join(f"[TOOL_CALLS]{n}[ARGS]{_args(a)}" for n, a in calls)


MAGISTRAL_FAMILY = Family(
    "magistral",
    "mistral",
    "mistral_v11",
    MAGISTRAL,
    (
        *MISTRAL_TOKENS,
        "[ARGS]",
        "[THINK]",
        "[/THINK]",
        "[SYSTEM_PROMPT]",
        "[/SYSTEM_PROMPT]",
    ),
    (),
    "</s>",
    "<s>",
    ("[THINK]", "[/THINK]"),
    {
        "one": _v11(ONE),
        "two": _v11(TWO),
        "content_then_call": PREFACE + _v11(ONE),
        "think_then_call": f"[THINK]{THOUGHT}[/THINK]{_v11(ONE)}",
        "answer": ANSWER,
        "think_then_answer": f"[THINK]{THOUGHT}[/THINK]{ANSWER}",
    },
    call_id="a1B2c3D4e",
)

# ---------------------------------------------------------------- Mistral Small 3.2 (NAME[ARGS]{...}, ids in history)

# As Magistral's, but the history carries each call's id, which the template checks (9 letters and digits, as
# Mistral Small 3.2's own does): calls as [TOOL_CALLS]NAME[CALL_ID]ID[ARGS]{...}, results as
# [TOOL_RESULTS]ID[TOOL_CONTENT]...[/TOOL_RESULTS]. The model writes its calls without ids.
MISTRAL_SMALL_32 = (
    "{{ bos_token }}"
    "{% if messages[0]['role'] == 'system' %}[SYSTEM_PROMPT]{{ messages[0]['content'] }}[/SYSTEM_PROMPT]"
    "{% set messages = messages[1:] %}{% endif %}"
    "{% set users = messages | selectattr('role', 'equalto', 'user') | list %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}"
    "{% if tools and m is sameas users[-1] %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "[INST]{{ m['content'] }}[/INST]"
    "{% elif m['role'] == 'assistant' %}{{ m['content'] or '' }}"
    "{% for c in m.get('tool_calls') or [] %}" + _MISTRAL_ID_CHECK.replace("@", "c['id']") + ""
    "[TOOL_CALLS]{{ c['function']['name'] }}[CALL_ID]{{ c['id'] }}[ARGS]{{ c['function']['arguments'] | tojson }}"
    "{% endfor %}{{ eos_token }}"
    "{% elif m['role'] == 'tool' %}" + _MISTRAL_ID_CHECK.replace("@", "m['tool_call_id']") + ""
    "[TOOL_RESULTS]{{ m['tool_call_id'] }}[TOOL_CONTENT]{{ m['content'] }}[/TOOL_RESULTS]"
    "{% else %}{{ raise_exception('Only user, assistant and tool roles are supported after the system message!') }}"
    "{% endif %}{% endfor %}"
)

MISTRAL_SMALL_32_FAMILY = Family(
    "mistral_small32",
    "mistral",
    "mistral_v11",
    MISTRAL_SMALL_32,
    (
        *MISTRAL_TOKENS,
        "[TOOL_CONTENT]",
        "[ARGS]",
        "[CALL_ID]",
        "[SYSTEM_PROMPT]",
        "[/SYSTEM_PROMPT]",
    ),
    (),
    "</s>",
    "<s>",
    None,
    {
        "one": _v11(ONE),
        "two": _v11(TWO),
        "content_then_call": PREFACE + _v11(ONE),
        "answer": ANSWER,
    },
    call_id="a1B2c3D4e",
)

# ---------------------------------------------------------------- Phi-4-mini

# The tools' JSON list in the system turn between <|tool|> and <|/tool|>; earlier calls in <|tool_call|>[...]
# <|/tool_call|>; results in a <|tool_response|> turn.
PHI4_MINI = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = 'You are a helpful assistant.' %}{% endif %}"
    "<|system|>{{ system }}{% if tools %}<|tool|>{{ tools | map(attribute='function') | list | tojson }}<|/tool|>"
    "{% endif %}<|end|>"
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|tool_response|>{{ m['content'] }}<|end|>"
    "{% elif m['role'] == 'assistant' %}<|assistant|>{{ m['content'] or '' }}"
    "{% if m.get('tool_calls') %}<|tool_call|>[{% for c in m['tool_calls'] %}"
    "{{ '{\"name\": \"' ~ c['function']['name'] ~ '\", \"arguments\": ' ~ (c['function']['arguments'] | tojson)"
    " ~ '}' }}{% if not loop.last %}, {% endif %}{% endfor %}]<|/tool_call|>{% endif %}<|end|>"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _json_list(calls: list[Call]) -> str:
    return json.dumps([{"name": n, "arguments": a} for n, a in calls])


PHI4_MINI_FAMILY = Family(
    "phi4_mini",
    "phi3",
    "phi4_mini",
    PHI4_MINI,
    (
        "<|endoftext|>",
        "<|system|>",
        "<|user|>",
        "<|assistant|>",
        "<|end|>",
        "<|tool|>",
        "<|/tool|>",
        "<|tool_call|>",
        "<|/tool_call|>",
        "<|tool_response|>",
    ),
    (),
    "<|end|>",
    None,
    None,
    {
        "one": f"<|tool_call|>{_json_list(ONE)}<|/tool_call|>",
        "two": f"<|tool_call|>{_json_list(TWO)}<|/tool_call|>",
        "answer": ANSWER,
    },
    stops=("<|endoftext|>",),
)

# ---------------------------------------------------------------- Granite 3.x

# Role headers <|start_of_role|>..<|end_of_role|>, turns end with <|end_of_text|>; the tools in an available_tools
# turn; earlier calls as <|tool_call|> and their JSON list; results in a tool_response turn.
GRANITE = (
    "{% if messages[0]['role'] == 'system' %}{% set system = messages[0]['content'] %}"
    "{% set messages = messages[1:] %}{% else %}{% set system = 'You are Granite, developed by IBM.'"
    " ~ (' You are a helpful AI assistant with access to the following tools. When a tool is required to answer the"
    " user\\'s query, respond with <|tool_call|> followed by a JSON list of tools used.' if tools else '') %}"
    "{% endif %}<|start_of_role|>system<|end_of_role|>{{ system }}<|end_of_text|>\n"
    "{% if tools %}<|start_of_role|>available_tools<|end_of_role|>"
    "{% for t in tools %}{{ t['function'] | tojson(indent=4) }}{% if not loop.last %}{{ '\\n\\n' }}{% endif %}"
    "{% endfor %}<|end_of_text|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and m.get('tool_calls') %}<|start_of_role|>assistant<|end_of_role|>"
    "{{ m['content'] or '' }}<|tool_call|>[{% for c in m['tool_calls'] %}"
    "{{ '{\"name\": \"' ~ c['function']['name'] ~ '\", \"arguments\": ' ~ (c['function']['arguments'] | tojson)"
    " ~ '}' }}{% if not loop.last %}, {% endif %}{% endfor %}]<|end_of_text|>\n"
    "{% elif m['role'] == 'tool' %}<|start_of_role|>tool_response<|end_of_role|>{{ m['content'] }}<|end_of_text|>\n"
    "{% else %}<|start_of_role|>{{ m['role'] }}<|end_of_role|>{{ m['content'] }}<|end_of_text|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start_of_role|>assistant<|end_of_role|>{% endif %}"
)

GRANITE_ARCH = Arch(
    "GraniteConfig",
    "GraniteForCausalLM",
    _DENSE_TINY,
    _DENSE_GPU,
    ("<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>"),
    "<|end_of_text|>",
    GRANITE,
)
"""Granite's weights, through transformers' Granite classes (not one of ``arch_models.ARCHS``)."""

GRANITE_FAMILY = Family(
    "granite",
    "granite",
    "granite",
    GRANITE,
    ("<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>"),
    (),
    "<|end_of_text|>",
    None,
    None,
    {
        "one": "<|tool_call|>" + _json_list(ONE),
        "two": "<|tool_call|>" + _json_list(TWO),
        "answer": ANSWER,
    },
)

# ---------------------------------------------------------------- DeepSeek V3 / R1 (distilled into Qwen2)

# The system text and the tools' JSON before the first turn; an earlier call as the tool-call block it was made in,
# results as tool-output blocks; the generation prompt opens the thinking block, and an earlier turn's thinking is
# dropped (R1's own template).
_DS_CALLS = (
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
)
_DS_OUTPUTS = ("<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>")
DEEPSEEK_V3 = (
    "{% set ns = namespace(system='', tool=false) %}"
    "{% for m in messages if m['role'] == 'system' %}"
    "{% set ns.system = ns.system ~ ('\\n\\n' if not loop.first else '') ~ m['content'] %}{% endfor %}"
    "{{ bos_token }}{{ ns.system }}"
    "{% if tools %}{{ '\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{% for t in tools %}{{ '\\n' ~ (t | tojson) }}{% endfor %}{{ '\\n</tools>\\n\\n' }}"
    "{{ 'For each function call, return <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>"
    "<function_name>\\n```json\\n<arguments>\\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}{% if ns.tool %}<｜tool▁outputs▁end｜>{% set ns.tool = false %}{% endif %}"
    "<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}"
    "{% if ns.tool %}<｜tool▁outputs▁end｜>{% set ns.tool = false %}{% endif %}<｜Assistant｜>"
    "{{ (m['content'] or '').split('</think>')[-1] }}"
    "{% if m.get('tool_calls') %}<｜tool▁calls▁begin｜>{% for c in m['tool_calls'] %}"
    "{% if not loop.first %}{{ '\\n' }}{% endif %}<｜tool▁call▁begin｜>{{ c.get('type') or 'function' }}<｜tool▁sep｜>"
    "{{ c['function']['name'] ~ '\\n```json\\n' ~ (c['function']['arguments'] | tojson) ~ '\\n```' }}"
    "<｜tool▁call▁end｜>{% endfor %}<｜tool▁calls▁end｜>{% endif %}<｜end▁of▁sentence｜>"
    "{% elif m['role'] == 'tool' %}"
    "{% if not ns.tool %}<｜tool▁outputs▁begin｜>{% set ns.tool = true %}{% else %}{{ '\\n' }}{% endif %}"
    "<｜tool▁output▁begin｜>{{ m['content'] }}<｜tool▁output▁end｜>"
    "{% endif %}{% endfor %}"
    "{% if ns.tool %}<｜tool▁outputs▁end｜>{% endif %}"
    "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}"
)


def _deepseek(calls: list[Call]) -> str:
    body = "\n".join(
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{_args(a)}\n```<｜tool▁call▁end｜>" for n, a in calls
    )
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


DEEPSEEK_FAMILY = Family(
    "deepseek_v3",
    "deepseek_r1_distill",
    "deepseek_v3",
    DEEPSEEK_V3,
    ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"),
    ("<think>", "</think>", *_DS_CALLS, *_DS_OUTPUTS),
    "<｜end▁of▁sentence｜>",
    "<｜begin▁of▁sentence｜>",
    ("<think>", "</think>"),
    {
        "one": "</think>\n\n" + _deepseek(ONE),
        "two": "</think>\n\n" + _deepseek(TWO),
        "content_then_call": f"</think>\n\n{PREFACE}{_deepseek(ONE)}",
        "think_then_call": f"{THOUGHT}\n</think>\n\n{_deepseek(ONE)}",
        "answer": f"</think>\n\n{ANSWER}",
        "think_then_answer": f"{THOUGHT}\n</think>\n\n{ANSWER}",
    },
    thinks_first=True,
)

# ---------------------------------------------------------------- GPT-OSS (harmony)

# A system message naming the channels, the tools as a TypeScript namespace in a developer message; an earlier
# turn's thinking in the analysis channel, its calls in the commentary channel addressed to functions.NAME, the
# results from functions.NAME to the assistant, its answer in the final channel.
HARMONY_TOOLS = (
    "{% macro ts(p) %}{% if p['enum'] is defined %}{% for v in p['enum'] %}{{ v | tojson }}"
    "{% if not loop.last %} | {% endif %}{% endfor %}{% elif p['type'] in ['integer', 'number'] %}number"
    "{% elif p['type'] in ['string', 'boolean'] %}{{ p['type'] }}{% elif p['type'] == 'array' %}any[]"
    "{% else %}any{% endif %}{% endmacro %}"
    "{% set ns = namespace(last='') %}"
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
    "Knowledge cutoff: 2024-06\n\nReasoning: {{ reasoning_effort | default('medium') }}\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every message."
    "{% if tools %}{{ '\\nCalls to these tools must go to the commentary channel: \\'functions\\'.' }}{% endif %}"
    "<|end|>"
    "{% set system = messages[0]['content'] if messages[0]['role'] in ['system', 'developer'] else '' %}"
    "{% if system or tools %}<|start|>developer<|message|>"
    "{% if system %}{{ '# Instructions\\n\\n' ~ system ~ ('\\n\\n' if tools else '') }}{% endif %}"
    "{% if tools %}{{ '# Tools\\n\\n## functions\\n\\nnamespace functions {\\n\\n' }}"
    "{% for t in tools %}{% set f = t['function'] %}{{ '// ' ~ f['description'] ~ '\\ntype ' ~ f['name'] ~ ' = ' }}"
    "{% set props = f['parameters']['properties'] if f['parameters'] is defined else {} %}"
    "{% if props %}{{ '(_: {\\n' }}{% for k, p in props | items %}"
    "{% if p['description'] is defined %}{{ '// ' ~ p['description'] ~ '\\n' }}{% endif %}"
    "{{ k ~ ('' if k in (f['parameters']['required'] or []) else '?') ~ ': ' ~ ts(p) ~ ',\\n' }}{% endfor %}"
    "{{ '}) => any;\\n\\n' }}{% else %}{{ '() => any;\\n\\n' }}{% endif %}{% endfor %}"
    "{{ '} // namespace functions' }}{% endif %}<|end|>{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|start|>user<|message|>{{ m['content'] }}<|end|>"
    "{% elif m['role'] == 'assistant' %}"
    "{% set thought = m.get('reasoning_content') or m.get('thinking') %}"
    "{% if thought and m.get('tool_calls') %}<|start|>assistant<|channel|>analysis<|message|>{{ thought }}<|end|>"
    "{% endif %}"
    "{% for c in m.get('tool_calls') or [] %}{% set ns.last = c['function']['name'] %}"
    "<|start|>assistant<|channel|>commentary to=functions.{{ c['function']['name'] }} <|constrain|>json<|message|>"
    "{{ c['function']['arguments'] | tojson }}<|call|>{% endfor %}"
    "{% if m['content'] %}<|start|>assistant<|channel|>final<|message|>{{ m['content'] }}<|end|>{% endif %}"
    "{% elif m['role'] == 'tool' %}<|start|>functions.{{ m.get('name') or ns.last }} to=assistant"
    "<|channel|>commentary<|message|>{{ m['content'] }}<|end|>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def _harmony(calls: list[Call]) -> str:
    return "<|start|>assistant".join(
        f"<|channel|>commentary to=functions.{n} <|constrain|>json<|message|>{_args(a)}<|call|>" for n, a in calls
    )


_ANALYSIS = f"<|channel|>analysis<|message|>{THOUGHT}<|end|><|start|>assistant"
HARMONY_FAMILY = Family(
    "gpt_oss",
    "gpt_oss",
    "harmony",
    HARMONY_TOOLS,
    (*ARCHS["gpt_oss"].specials, "<|constrain|>"),
    (),
    "<|return|>",
    None,
    ("<|channel|>analysis<|message|>", "<|end|>"),
    {
        "one": _harmony(ONE),
        "two": _harmony(TWO),
        "content_then_call": f"<|channel|>commentary<|message|>{PREFACE}<|end|><|start|>assistant{_harmony(ONE)}",
        "think_then_call": _ANALYSIS + _harmony(ONE),
        "answer": f"<|channel|>final<|message|>{ANSWER}<|return|>",
        "think_then_answer": f"{_ANALYSIS}<|channel|>final<|message|>{ANSWER}<|return|>",
    },
    stops=("<|call|>",),
)

# ---------------------------------------------------------------- the 2026 families (tests/data/chat_templates)


def _thinks_first(calls: dict[str, str], close: str = "\n</think>\n\n") -> dict[str, str]:
    """The replies ``one`` ... ``think_then_answer`` of a family that starts inside its thinking block."""
    return {
        "one": close.lstrip("\n") + calls["one"],
        "two": close.lstrip("\n") + calls["two"],
        "content_then_call": close.lstrip("\n") + calls["content_then_call"],
        "think_then_call": THOUGHT + close + calls["one"],
        "answer": close.lstrip("\n") + ANSWER,
        "think_then_answer": THOUGHT + close + ANSWER,
    }


_CHATML_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

QWEN3_5_FAMILY = Family(
    "qwen3_5",
    "qwen3_5",
    "qwen3_coder",
    template_file("qwen3_5"),
    _CHATML_TOKENS,
    _HERMES_PLAIN,
    "<|im_end|>",
    None,
    ("<think>", "</think>"),
    _thinks_first({"one": _xml(ONE), "two": _xml(TWO), "content_then_call": f"{PREFACE}\n\n{_xml(ONE)}"}),
    stops=("<|endoftext|>",),
    thinks_first=True,
)


def _glm(calls: list[Call]) -> str:
    def params(a: dict[str, Any]) -> str:
        return "".join(
            f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else json.dumps(v)}</arg_value>\n"
            for k, v in a.items()
        )

    return "\n".join(f"<tool_call>{n}\n{params(a)}</tool_call>" for n, a in calls)


_GLM_PLAIN = ("<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>")
GLM45_FAMILY = Family(
    "glm45",
    "glm4_moe",
    "glm45",
    template_file("glm45"),
    ("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"),
    (*_GLM_PLAIN, "</arg_value>", "<tool_response>", "</tool_response>"),
    "<|endoftext|>",
    None,
    ("<think>", "</think>"),
    {
        "one": f"\n<think></think>\n{_glm(ONE)}",
        "two": f"\n<think></think>\n{_glm(TWO)}",
        "content_then_call": f"\n<think></think>\n{PREFACE}\n{_glm(ONE)}",
        "think_then_call": f"\n<think>{THOUGHT}</think>\n{_glm(ONE)}",
        "answer": f"\n<think></think>\n{ANSWER}",
        "think_then_answer": f"\n<think>{THOUGHT}</think>\n{ANSWER}",
    },
    stops=("<|user|>", "<|observation|>"),
)


def _minimax(calls: list[Call]) -> str:
    def params(a: dict[str, Any]) -> str:
        return "".join(
            f'<parameter name="{k}">{v if isinstance(v, str) else json.dumps(v)}</parameter>\n' for k, v in a.items()
        )

    return (
        "<minimax:tool_call>\n"
        + "".join(f'<invoke name="{n}">\n{params(a)}</invoke>\n' for n, a in calls)
        + "</minimax:tool_call>"
    )


MINIMAX_M2_FAMILY = Family(
    "minimax_m2",
    "minimax_m2",
    "minimax_m2",
    template_file("minimax_m2"),
    ("]~!b[", "]~b]", "[e~["),
    ("<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>"),
    "[e~[",
    None,
    ("<think>", "</think>"),
    _thinks_first({"one": _minimax(ONE), "two": _minimax(TWO), "content_then_call": f"{PREFACE}\n{_minimax(ONE)}"}),
    thinks_first=True,
)


def _deepseek31(calls: list[Call]) -> str:
    body = "".join(f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{_args(a)}<｜tool▁call▁end｜>" for n, a in calls)
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


DEEPSEEK_V31_FAMILY = Family(
    "deepseek_v31",
    "deepseek_v3",
    "deepseek_v31",
    template_file("deepseek_v31"),
    ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"),
    ("<think>", "</think>", *_DS_CALLS, "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"),
    "<｜end▁of▁sentence｜>",
    "<｜begin▁of▁sentence｜>",
    None,  # the generation prompt closes the thinking block unless thinking is asked for
    {
        "one": _deepseek31(ONE),
        "two": _deepseek31(TWO),
        "content_then_call": PREFACE + _deepseek31(ONE),
        "answer": ANSWER,
    },
)


def _dsml(calls: list[Call]) -> str:
    def params(a: dict[str, Any]) -> str:
        return "".join(
            f'\n<｜DSML｜parameter name="{k}" string="{"true" if isinstance(v, str) else "false"}">'
            f"{v if isinstance(v, str) else json.dumps(v)}</｜DSML｜parameter>"
            for k, v in a.items()
        )

    body = "".join(f'\n<｜DSML｜invoke name="{n}">{params(a)}\n</｜DSML｜invoke>' for n, a in calls)
    return f"<｜DSML｜tool_calls>{body}\n</｜DSML｜tool_calls>"


DEEPSEEK_V4_FAMILY = Family(
    "deepseek_v4",
    "deepseek_v4",
    "deepseek_v4",
    template_file("deepseek_v4"),
    ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "｜DSML｜"),
    ("<think>", "</think>"),
    "<｜end▁of▁sentence｜>",
    "<｜begin▁of▁sentence｜>",
    ("<think>", "</think>"),
    _thinks_first(
        {"one": "\n\n" + _dsml(ONE), "two": "\n\n" + _dsml(TWO), "content_then_call": f"{PREFACE}\n\n{_dsml(ONE)}"},
        close="</think>",
    ),
    thinks_first=True,
)


def _gemma4(calls: list[Call]) -> str:
    def value(v: Any) -> str:
        return f'<|"|>{v}<|"|>' if isinstance(v, str) else json.dumps(v)

    return "".join(
        "<|tool_call>call:" + n + "{" + ",".join(f"{k}:{value(v)}" for k, v in sorted(a.items())) + "}<tool_call|>"
        for n, a in calls
    )


GEMMA4_FAMILY = Family(
    "gemma4",
    "gemma4",
    "gemma4",
    template_file("gemma4"),
    ARCHS_2026["gemma4"].specials,
    (),
    "<turn|>",
    "<bos>",
    None,  # thinking is off unless enable_thinking: the generation prompt closes an empty thought channel
    {"one": _gemma4(ONE), "two": _gemma4(TWO), "content_then_call": PREFACE + _gemma4(ONE), "answer": ANSWER},
    stops=("<|tool_response>", "<eos>"),
)


NEMOTRON_FAMILY = Family(
    "nemotron",
    "nemotron_h",
    "nemotron",
    template_file("nemotron_h"),
    ("<SPECIAL_10>", "<SPECIAL_11>", "<SPECIAL_12>", "<TOOLCALL>", "</TOOLCALL>", "<AVAILABLE_TOOLS>"),
    ("</AVAILABLE_TOOLS>", "<TOOL_RESPONSE>", "</TOOL_RESPONSE>", "<think>", "</think>"),
    "<SPECIAL_12>",
    None,
    ("<think>", "</think>"),
    _thinks_first(
        {
            "one": f"<TOOLCALL>{_json_list(ONE)}</TOOLCALL>",
            "two": f"<TOOLCALL>{_json_list(TWO)}</TOOLCALL>",
            "content_then_call": f"{PREFACE}\n\n<TOOLCALL>{_json_list(ONE)}</TOOLCALL>",
        }
    ),
    thinks_first=True,
)


def _kimi(calls: list[Call]) -> str:
    body = "".join(
        f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{_args(a)}<|tool_call_end|>"
        for i, (n, a) in enumerate(calls)
    )
    return f"<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"


KIMI_FAMILY = Family(
    "kimi_k2",
    "kimi_linear",
    "kimi_k2",
    template_file("kimi_linear"),
    ARCHS_2026["kimi_linear"].specials,
    (),
    "<|im_end|>",
    None,  # its template writes no BOS
    None,
    {"one": _kimi(ONE), "two": _kimi(TWO), "content_then_call": PREFACE + _kimi(ONE), "answer": ANSWER},
    call_id="functions.get_weather:0",
)


# ---------------------------------------------------------------- TabbyAPI's hy3 and muse_glimmer formats

_HY3_TOKENS = ("<think:opensource>", "</think:opensource>", "<tool_calls:opensource>", "</tool_calls:opensource>")
_HY3_TOKENS += ("<tool_call:opensource>", "</tool_call:opensource>", "<tool_sep:opensource>", "<arg_key:opensource>")
_HY3_TOKENS += ("</arg_key:opensource>", "<arg_value:opensource>", "</arg_value:opensource>")
_HY3_TOKENS += ("<tool_responses:opensource>", "</tool_responses:opensource>", "<tool_response:opensource>")
_HY3_TOKENS += ("</tool_response:opensource>",)


def _hy3(calls: list[Call]) -> str:
    def params(a: dict[str, Any]) -> str:
        return "".join(
            f"<arg_key:opensource>{k}</arg_key:opensource>\n<arg_value:opensource>"
            f"{v if isinstance(v, str) else json.dumps(v)}</arg_value:opensource>\n"
            for k, v in a.items()
        )

    body = "".join(
        f"<tool_call:opensource>{n}<tool_sep:opensource>\n{params(a)}</tool_call:opensource>\n" for n, a in calls
    )
    return f"<tool_calls:opensource>\n{body}</tool_calls:opensource>"


HY3_ARCH = Arch(
    "HYV3Config",
    "HYV3ForCausalLM",
    {**_DENSE_TINY, "num_experts": 4, "num_experts_per_tok": 2, "num_shared_experts": 1, "moe_intermediate_size": 32},
    {**_DENSE_GPU, "num_experts": 4, "num_experts_per_tok": 2, "num_shared_experts": 1, "moe_intermediate_size": 128},
    (),
    "<｜hy_eos:opensource｜>",
    template_file("hy3"),
)
HY3_FAMILY = Family(
    "hy3",
    "hy_v3",
    "hy3",
    template_file("hy3"),
    ("<｜hy_begin_of_sentence:opensource｜>", "<｜hy_User:opensource｜>", "<｜hy_Assistant:opensource｜>")
    + ("<｜hy_eos:opensource｜>", "<｜reasoning_mode:opensource｜>", *_HY3_TOKENS),
    (),
    "<｜hy_eos:opensource｜>",
    "<｜hy_begin_of_sentence:opensource｜>",
    None,  # reasoning_effort no_think (the template's default): the generation prompt closes the thinking block
    {"one": _hy3(ONE), "two": _hy3(TWO), "content_then_call": PREFACE + _hy3(ONE), "answer": ANSWER},
)


def _glimmer(calls: list[Call]) -> str:
    def params(a: dict[str, Any]) -> str:
        return "".join(
            f'<atem:parameter name="{k}">{v if isinstance(v, str) else json.dumps(v)}</atem:parameter>\n'
            for k, v in a.items()
        )

    return "<|eom|><|start|>assistant".join(
        f' to={n}<|message|><atem:function_calls>\n<atem:invoke name="{n}">\n{params(a)}</atem:invoke>\n'
        "</atem:function_calls>"
        for n, a in calls
    )


_TO_SELF = f" to=self<|message|>{THOUGHT}<|eom|><|start|>assistant"
MUSE_GLIMMER_FAMILY = Family(
    "muse_glimmer",
    "qwen3",  # (transformers has Muse Glimmer as an image-text model only: the tokenizer-level tests use its tokens)
    "muse_glimmer",
    template_file("muse_glimmer"),
    ("<|start|>", "<|message|>", "<|eom|>", "<|eot|>", "<|end_of_text|>"),
    (),
    "<|eot|>",
    None,
    ("to=self<|message|>", "<|eom|>"),
    {
        "one": _glimmer(ONE),
        "two": _glimmer(TWO),
        "content_then_call": f" to=user<|message|>{PREFACE}<|eom|><|start|>assistant{_glimmer(ONE)}",
        "think_then_call": _TO_SELF + _glimmer(ONE),
        "answer": f" to=user<|message|>{ANSWER}",
        "think_then_answer": f"{_TO_SELF} to=user<|message|>{ANSWER}",
    },
    stops=("<|end_of_text|>",),
)


# ---------------------------------------------------------------- no native format: the documented fallback


def _fallback(calls: list[Call]) -> str:
    return "".join(f'<tool_call>{{"name": "{n}", "arguments": {_args(a)}}}</tool_call>' for n, a in calls)


def _fallback_family(name: str) -> Family:
    arch = ARCHS[name]
    return Family(
        name,
        name,
        "fallback",
        arch.template,
        arch.specials,
        (),
        arch.eos,
        arch.bos,
        None,
        {"one": _fallback(ONE), "two": _fallback(TWO), "answer": ANSWER},
    )


FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        HERMES,
        QWEN3_CODER_FAMILY,
        LLAMA3_FAMILY,
        LLAMA4_FAMILY,
        MISTRAL_FAMILY,
        MAGISTRAL_FAMILY,
        MISTRAL_SMALL_32_FAMILY,
        PHI4_MINI_FAMILY,
        GRANITE_FAMILY,
        DEEPSEEK_FAMILY,
        HARMONY_FAMILY,
        _fallback_family("phi3"),
        _fallback_family("gemma3"),
    )
}
FAMILIES_2026: dict[str, Family] = {
    f.name: f
    for f in (
        QWEN3_5_FAMILY,
        GLM45_FAMILY,
        MINIMAX_M2_FAMILY,
        DEEPSEEK_V31_FAMILY,
        DEEPSEEK_V4_FAMILY,
        GEMMA4_FAMILY,
        NEMOTRON_FAMILY,
        KIMI_FAMILY,
        HY3_FAMILY,
    )
}
"""The 2026 families' tool formats, on their own architectures (``arch_families.ARCHS_2026``)."""
FAMILIES.update(FAMILIES_2026)
FAMILIES_TOKENIZER_ONLY: dict[str, Family] = {MUSE_GLIMMER_FAMILY.name: MUSE_GLIMMER_FAMILY}
"""Families whose architecture transformers has as an image-text model only: read, streamed and forced through
their tokenizer and template (tests/unit), not run end to end."""
FAMILIES.update(FAMILIES_TOKENIZER_ONLY)
EXTRA_ARCHS: dict[str, Arch] = {"granite": GRANITE_ARCH, "hy_v3": HY3_ARCH}
"""Weights a family uses that are not one of ``arch_models.ARCHS``."""

QUESTION = "What is the weather in Paris?"


def history(family: Family | str, json_arguments: bool = False) -> list[dict[str, Any]]:
    """A two-turn agent history: the question, the assistant's get_weather call, the tool's result.

    Arguments are objects, as templates receive them (``json_arguments=True``: JSON strings, as OpenAI clients send
    them); the call id is one the family's template accepts.
    """
    fam = FAMILIES[family] if isinstance(family, str) else family
    args: Any = {"city": "Paris"}
    call = {"id": fam.call_id, "type": "function", "function": {"name": "get_weather", "arguments": args}}
    if json_arguments:
        call["function"] = {"name": "get_weather", "arguments": json.dumps(args)}
    return [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": fam.call_id, "name": "get_weather", "content": RESULT},
    ]


def _arch(family: Family) -> Arch:
    base = EXTRA_ARCHS.get(family.arch) or ARCHS.get(family.arch) or ARCHS_2026[family.arch]
    return replace(
        base,
        specials=(*family.specials, *family.plain),
        eos=family.eos,
        bos=family.bos,
        template=family.template,
    )


def _mark_specials(out: Path, family: Family, ids: dict[str, int]) -> None:
    """Set each added token's special flag as the family has it; every end-of-turn token in generation_config."""
    path = out / "tokenizer.json"
    tok = json.loads(path.read_text(encoding="utf-8"))
    for added in tok["added_tokens"]:
        added["special"] = added["content"] not in family.plain
    path.write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
    gen_path = out / "generation_config.json"
    gen = json.loads(gen_path.read_text())
    if family.stops:
        gen["eos_token_id"] = [ids[family.eos], *(ids[s] for s in family.stops)]
    gen_path.write_text(json.dumps(gen))


def make_tokenizer(name: str, out: Path, vocab: int = 512) -> Path:
    """Write only ``name``'s tokenizer files (tokenizer.json, tokenizer_config.json, generation_config.json)."""
    from arch_models import _tokenizer

    family = FAMILIES[name]
    out.mkdir(parents=True, exist_ok=True)
    ids = _tokenizer(out, vocab, _arch(family))
    _mark_specials(out, family, ids)
    return out


def make_family(name: str, out: Path, size: str = "tiny", seed: int = 0, device: str = "cpu") -> Path:
    """Write a random-weight model of family ``name`` to ``out`` (see the module docstring); returns ``out``."""
    family = FAMILIES[name]
    arch = _arch(family)
    make_arch(arch, out, size=size, seed=seed, device=device)
    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    tok = json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))
    ids = {a["content"]: a["id"] for a in tok["added_tokens"]}
    assert len(ids) == len(arch.specials) and vocab >= max(ids.values()) + 1
    _mark_specials(out, family, ids)
    return out


__all__ = ["EXPECTED", "EXPECTED_TEXT", "FAMILIES", "TOOLS", "Family", "history", "make_family", "make_tokenizer"]


@dataclass
class TokenizerFiles:
    """A tokenizer-only model directory, as NativeTokenizer reads one."""

    path: Path

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def tokenizer_json(self) -> Path:
        return self.path / "tokenizer.json"

    @property
    def tokenizer_model(self) -> None:
        return None

    @property
    def tokenizer_config(self) -> dict[str, Any]:
        return dict(json.loads((self.path / "tokenizer_config.json").read_text()))

    @property
    def generation_config(self) -> dict[str, Any]:
        return dict(json.loads((self.path / "generation_config.json").read_text()))

    @property
    def config(self) -> dict[str, Any]:
        return {}

    @property
    def chat_template(self) -> str | None:
        return self.tokenizer_config.get("chat_template")


def family_tokenizer(name: str, out: Path) -> Any:
    """``name``'s tokenizer (a NativeTokenizer) without weights, its files written to ``out``."""
    from exllama_integrations.model.tokenizer import NativeTokenizer

    make_tokenizer(name, out)
    return NativeTokenizer(TokenizerFiles(out))
