"""gpt-oss's chat format (OpenAI's "harmony"), as a chat template for files that carry
none: the text it gives is the text of the template the gpt-oss checkpoints ship, for
every conversation that template renders.

A conversation is a system message (the model's identity, knowledge cutoff, today's date,
``Reasoning: <reasoning_effort>``, default medium, and the valid channels), a developer
message (a leading system or developer message's text as its instructions, and the
``tools`` as a TypeScript namespace ``functions``), then the turns. Earlier answers keep
only their final channel; an assistant's tool call goes to the commentary channel
(``to=functions.NAME``, its arguments as JSON), preceded by its reasoning unless a later
answer follows it; a tool's result comes from ``functions.NAME``. Renderings that ship
template refuses (channel tags in a message, both content and thinking beside a tool
call, a tool result with no call before it) are refused here too; the browser and python
built-in tools (``builtin_tools``) are refused rather than described.

The tool schemas' TypeScript follows the shipped template to the character, its quirks
included: an object's properties each start a new line indented by 16 spaces, a ``oneOf``
variant's default by 20, and its alternatives are separated by ``" | "`` and a newline.
"""

_IDENTITY = "You are ChatGPT, a large language model trained by OpenAI."
_ANALYSIS, _FINAL = "<|channel|>analysis<|message|>", "<|channel|>final<|message|>"

# A JSON schema as a TypeScript type.
_TYPESCRIPT = (
    "{% macro ts_type(spec) %}"
    "{% if spec.type == 'array' %}"
    "{% if spec['items'] %}"
    "{% set item = spec['items']['type'] %}"
    "{% if item in ('number', 'integer') %}number[]"
    "{% elif item in ('string', 'boolean') %}{{ item }}[]"
    "{% else %}{% set inner = ts_type(spec['items']) %}"
    "{{ 'any' if inner == 'object | object' or inner | length > 50 else inner }}[]"
    "{% endif %}"
    "{% else %}any[]{% endif %}"
    "{% if spec.nullable %} | null{% endif %}"
    "{% elif spec.type is iterable and spec.type is not string and spec.type is not mapping"
    " and spec.type | length > 0 %}{{ spec.type | join(' | ') }}"
    "{% elif spec.oneOf %}"
    "{% for variant in spec.oneOf %}{{ ts_type(variant) }}"
    "{% if variant.description %}// {{ variant.description }}{% endif %}"
    "{% if variant.default is defined %}" + " " * 20 + "// default: "
    "{{ variant.default | tojson }}{% endif %}"
    "{% if not loop.last %} | \n{% endif %}"
    "{% endfor %}"
    "{% elif spec.type == 'string' %}"
    '{% if spec.enum %}"{{ spec.enum | join(\'" | "\') }}"'
    "{% else %}string{% if spec.nullable %} | null{% endif %}{% endif %}"
    "{% elif spec.type in ('number', 'integer') %}number"
    "{% elif spec.type == 'boolean' %}boolean"
    "{% elif spec.type == 'object' %}"
    "{% if spec.properties %}{\n"
    "{% for name, property in spec.properties.items() %}"
    "{{ name }}{% if name not in (spec.required or []) %}?{% endif %}: \n" + " " * 16 + ""
    "{{ ts_type(property) }}{% if not loop.last %}, {% endif %}"
    "{% endfor %}}"
    "{% else %}object{% endif %}"
    "{% else %}any{% endif %}"
    "{% endmacro %}"
)
# The functions the developer message offers: one TypeScript type per tool.
_FUNCTIONS = (
    "{% macro functions(tools) %}## functions\n\nnamespace functions {\n\n"
    "{% for tool in tools %}{% set fn = tool.function %}"
    "{% if fn.description is defined %}// {{ fn.description }}\n{% endif %}"
    "type {{ fn.name }} = "
    "{% if fn.parameters and fn.parameters.properties %}(_: {\n"
    "{% for name, spec in fn.parameters.properties.items() %}"
    "{% if spec.description %}// {{ spec.description }}\n{% endif %}"
    "{{ name }}{% if name not in (fn.parameters.required or []) %}?{% endif %}: "
    "{{ ts_type(spec) }}"
    "{% if spec.default is defined %}"
    "{% if spec.enum %}, // default: {{ spec.default }}"
    "{% elif spec.oneOf %}// default: {{ spec.default }}"
    "{% else %}, // default: {{ spec.default | tojson }}{% endif %}"
    "{% endif %},\n"
    "{% endfor %}}) => any;\n\n"
    "{% else %}() => any;\n\n{% endif %}"
    "{% endfor %}} // namespace functions{% endmacro %}"
)
_SYSTEM = (
    "{% if builtin_tools %}{{ raise_exception('the built-in browser and python tools "
    "(builtin_tools) are not supported by this template') }}{% endif %}"
    "<|start|>system<|message|>{{ model_identity | default('" + _IDENTITY + "') }}\n"
    "Knowledge cutoff: 2024-06\nCurrent date: {{ strftime_now('%Y-%m-%d') }}\n\n"
    "Reasoning: {{ reasoning_effort | default('medium') }}\n\n"
    "# Valid channels: analysis, commentary, final. Channel must be included for every "
    "message.{% if tools %}{{ '\\n' }}Calls to these tools must go to the commentary "
    "channel: 'functions'.{% endif %}<|end|>"
)
_DEVELOPER = (
    "{% if messages[0].role in ('system', 'developer') %}"
    "{% set instructions, turns = messages[0].content, messages[1:] %}"
    "{% else %}{% set instructions, turns = '', messages %}{% endif %}"
    "{% if instructions or tools %}<|start|>developer<|message|>"
    "{% if instructions %}# Instructions\n\n{{ instructions }}\n\n{% endif %}"
    "{% if tools %}# Tools\n\n{{ functions(tools) }}{% endif %}<|end|>{% endif %}"
)
# An assistant turn: a tool call (the first of its calls), an earlier answer (its final
# channel only), or the last turn of a rendering without a generation prompt (a training
# example: its reasoning too, and <|return|>).
_ASSISTANT = (
    "{% for field in ('content', 'thinking') %}"
    "{% if message[field] is string and ('" + _ANALYSIS + "' in message[field] or '"
    "" + _FINAL + "' in message[field]) %}"
    '{{ raise_exception("an assistant message\'s " ~ field ~ " holds channel tags: give '
    'its reasoning as thinking and its answer as content") }}{% endif %}{% endfor %}'
    "{% if 'tool_calls' in message %}"
    "{% set call = message.tool_calls[0] %}{% set call = call.function or call %}"
    "{% set answered = turns[loop.index:] | selectattr('role', 'equalto', 'assistant')"
    " | rejectattr('tool_calls', 'defined') | list %}"
    "{% if message.content and message.thinking %}"
    "{{ raise_exception('an assistant message with tool calls may give content or "
    "thinking as its reasoning, not both') }}"
    "{% elif not answered and (message.content or message.thinking) %}"
    "<|start|>assistant" + _ANALYSIS + "{{ message.content or message.thinking }}<|end|>"
    "{% endif %}"
    "<|start|>assistant to=functions.{{ call.name }}<|channel|>commentary "
    "{{ call.content_type if call.content_type is defined else 'json' }}<|message|>"
    "{{ call.arguments | tojson }}<|call|>{% set state.called = call.name %}"
    "{% elif loop.last and not add_generation_prompt %}"
    "{% if 'thinking' in message %}<|start|>assistant" + _ANALYSIS + ""
    "{{ message.thinking }}<|end|>{% endif %}"
    "<|start|>assistant" + _FINAL + "{{ message.content }}<|return|>"
    "{% else %}<|start|>assistant" + _FINAL + "{{ message.content }}<|end|>"
    "{% set state.called = none %}{% endif %}"
)
_TURNS = (
    "{% set state = namespace(called=none) %}"
    "{% for message in turns %}"
    "{% if message.role == 'assistant' %}" + _ASSISTANT + ""
    "{% elif message.role == 'tool' %}"
    "{% if state.called is none %}{{ raise_exception('a tool message needs an assistant "
    "tool call before it') }}{% endif %}"
    "<|start|>functions.{{ state.called }} to=assistant<|channel|>commentary<|message|>"
    "{{ message.content | tojson }}<|end|>"
    "{% elif message.role == 'user' %}<|start|>user<|message|>{{ message.content }}<|end|>"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
HARMONY_CHAT_TEMPLATE = _TYPESCRIPT + _FUNCTIONS + _SYSTEM + _DEVELOPER + _TURNS
