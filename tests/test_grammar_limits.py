"""No request can make the server answer 5xx through a grammar: every limit the grammar
engine has (its JSON reader's nesting, its regex and grammar parsers) or the tools'
translation has is a 400 naming the parameter, for schemas, regexes, grammars and tool
parameters drawn by hypothesis as well as for the deep nestings that once gave a 500."""

import gc
import json
import threading
import time

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from live_server import MODEL, served_backend
from test_tools import TOOL_TEMPLATE

from spnl_backend.memory import heap_in_use

CI = settings(
    max_examples=40,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
ASK = [{"role": "user", "content": "go"}]


@pytest.fixture(scope="module")
def backend(tiny):
    backend = served_backend(tiny, TOOL_TEMPLATE)
    yield backend
    backend.close()


def _nested(depth: int, kind: str) -> str:
    """A schema nested ``depth`` deep, as JSON text (too deep for json.dumps to write)."""
    opening = {
        "array": '{"type": "array", "items": ',
        "object": '{"type": "object", "required": ["a"], "properties": {"a": ',
        "anyOf": '{"anyOf": [{"type": "null"}, ',
    }[kind]
    closing = {"array": "}", "object": "}}", "anyOf": "]}"}[kind]
    return opening * depth + '{"type": "string"}' + closing * depth


def _raw(live, path: str, head: str, schema: str, tail: str) -> httpx.Response:
    body = head + schema + tail
    headers = {"Content-Type": "application/json"}
    return httpx.post(live.url + path, content=body.encode(), headers=headers, timeout=60)


def _post(live, body: dict) -> httpx.Response:
    return live.post("/v1/chat/completions", {"model": MODEL, "messages": ASK, **body})


def _schema_format(schema: object) -> dict:
    return {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}}


@pytest.mark.parametrize("kind", ["array", "object", "anyOf"])
@pytest.mark.parametrize("depth", [127, 301, 2000])
def test_deeply_nested_schemas_are_400s_naming_the_parameter(live, kind, depth):
    head = (
        f'{{"model": "{MODEL}", "max_tokens": 4, "messages": [{{"role": "user", '
        '"content": "go"}], "response_format": {"type": "json_schema", "json_schema": '
        '{"schema": '
    )
    reply = _raw(live, "/v1/chat/completions", head, _nested(depth, kind), "}}}")
    assert reply.status_code in (200, 400), reply.text
    if reply.status_code == 400:
        error = reply.json()["error"]
        assert "response_format" in error["message"] or "JSON" in error["message"]
        assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("depth", [301, 2000])
def test_deeply_nested_tool_parameters_are_400s(live, depth):
    head = (
        f'{{"model": "{MODEL}", "max_tokens": 4, "messages": [{{"role": "user", '
        '"content": "go"}], "tool_choice": "required", "tools": [{"type": "function", '
        '"function": {"name": "f", "parameters": '
    )
    reply = _raw(live, "/v1/chat/completions", head, _nested(depth, "object"), "}}]}")
    assert reply.status_code == 400, reply.text


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=12,
)
SCHEMA_WORDS = st.sampled_from(
    ["type", "items", "properties", "required", "anyOf", "enum", "const", "pattern", "$ref"]
)
SCHEMAS = st.recursive(
    st.sampled_from(
        [{"type": t} for t in ("string", "integer", "number", "boolean", "null", "object")]
    ),
    lambda inner: st.dictionaries(SCHEMA_WORDS, inner | JSON_VALUES, max_size=3),
    max_leaves=10,
)


@CI
@given(schema=SCHEMAS | JSON_VALUES)
def test_any_schema_is_answered_or_refused_never_a_5xx(live, schema):
    reply = _post(live, {**_schema_format(schema), "max_tokens": 2})
    assert reply.status_code < 500, reply.text


@CI
@given(pattern=st.text(max_size=40))
def test_any_regex_or_grammar_is_answered_or_refused_never_a_5xx(live, pattern):
    for body in ({"regex": pattern}, {"grammar": pattern}, {"guided_regex": pattern}):
        reply = live.post(
            "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2, **body}
        )
        assert reply.status_code < 500, reply.text


@CI
@given(parameters=SCHEMAS)
@example(  # once a panic of the library's, formatting its message (a 500 then)
    parameters={
        "required": {
            "": None,
            "0": -1000000000000000000,
            "0\x80\u0800\U00010000\U00010000\U00010000": None,
            "00\x17\U00010000": "000\x17\x80\U00010000",
            "00\\\U00010000": "\x80\x80",
        }
    }
)
def test_any_tool_parameters_are_answered_or_refused_never_a_5xx(live, parameters):
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    reply = _post(live, {"tools": [tool], "tool_choice": "required", "max_tokens": 2})
    assert reply.status_code < 500, reply.text


def test_an_unknown_model_is_a_404_before_its_schema_is_read(live):
    """(A schema within the body's nesting limit: a deeper body is refused as it is read.)"""
    head = (
        '{"model": "no-such-model", "max_tokens": 4, "messages": [{"role": "user", '
        '"content": "go"}], "response_format": {"type": "json_schema", "json_schema": '
        '{"schema": '
    )
    reply = _raw(live, "/v1/chat/completions", head, _nested(70, "array"), "}}}")
    assert reply.status_code == 404, reply.text
    assert reply.json()["error"]["code"] == "model_not_found"


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "integer", "maximum": 10**400},
        {"enum": [10**400]},
        {"const": -(10**400)},
    ],
    ids=["maximum", "enum", "const"],
)
def test_integers_too_large_for_the_engine_are_400s(live, schema):
    reply = _post(live, {**_schema_format(schema), "max_tokens": 2})
    assert reply.status_code == 400, reply.text
    assert "out of range" in reply.json()["error"]["message"]


def test_the_python_api_raises_the_librarys_own_error(backend):
    from spnl_backend.errors import RequestError

    with pytest.raises(RequestError, match="nested at most 127 levels"):
        backend.generate("x", max_tokens=2, json_schema=json.loads(_nested(200, "array")))


# ---- GBNF grammars: converted in linear time, off the event loop ----------------------

GBNF_JSON = r"""
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9]+)? ws
# a comment the Lark text keeps
ws ::= | " " | "\n" [ \t]{0,20}
"""


def _chain(rules: int, loop_back: bool = False) -> str:
    """``rules`` rules each using the next: terminals all, or (``loop_back``) none."""
    tail = '"end" root' if loop_back else '"end"'
    body = "".join(f'r{i} ::= "x{i}" r{i + 1} | "y"\n' for i in range(rules))
    return f"root ::= r0\n{body}r{rules} ::= {tail}\n"


@pytest.mark.parametrize(
    "grammar",
    [
        'root ::= "(" digit+ ")"\ndigit ::= [0-9]',
        GBNF_JSON,
        _chain(60),
        _chain(60, loop_back=True),
        'root ::= fooBar my-rule\nfooBar ::= "a"*\nmy-rule ::= ( "b" | "c" ){2,5} .\n',
    ],
    ids=["digits", "json", "terminal-chain", "cycle", "names"],
)
def test_gbnf_converts_to_the_lark_llguidances_converter_writes(grammar):
    from llguidance.gbnf_to_lark import any_to_lark

    from spnl_backend.constrain.gbnf import to_lark

    assert to_lark(grammar) == any_to_lark(grammar)


@pytest.mark.parametrize(
    ("grammar", "message"),
    [
        ('root ::= "a" missing', "rule 'missing' is used but never defined"),
        ('top ::= "a"\n', "needs a 'root' rule"),
        ('root ::= foo-bar foo_bar\nfoo-bar ::= "a"\nfoo_bar ::= "b"', "both named 'FOO_BAR'"),
        ('root ::= "a', "Unexpected end of input"),
    ],
)
def test_a_gbnf_grammar_that_does_not_link_is_a_request_error(grammar, message):
    from spnl_backend.constrain.spec import grammar_spec
    from spnl_backend.errors import RequestError

    with pytest.raises(RequestError, match=message):
        grammar_spec(grammar)


def test_an_8000_rule_gbnf_grammar_is_answered(live):
    # 182 KB: llguidance's own converter took 104 s on it (quadratic in the rules).
    grammar = _chain(8000)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "guided_grammar": grammar}
    reply = live.post("/v1/completions", body)
    assert reply.status_code == 200, reply.text


def test_health_answers_while_a_request_is_being_prepared(live, monkeypatch):
    """A grammar's conversion is held until /health has answered: were the request read
    on the event loop, /health could not answer and the conversion would run out."""
    import threading

    from spnl_backend.constrain import spec

    converting, answered = threading.Event(), threading.Event()
    convert = spec.to_lark

    collecting: list[bool] = []

    def held(text: str) -> str:
        collecting.append(gc.isenabled())
        converting.set()
        assert answered.wait(30), "/health did not answer while a grammar was converted"
        return convert(text)

    monkeypatch.setattr(spec, "to_lark", held)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "guided_grammar": _chain(8000)}
    outcome: list[httpx.Response] = []
    sender = threading.Thread(target=lambda: outcome.append(live.post("/v1/completions", body)))
    sender.start()
    assert converting.wait(30)
    health = httpx.get(live.url + "/health", timeout=20)
    answered.set()
    sender.join(60)
    assert health.status_code == 200
    (reply,) = outcome
    assert reply.status_code == 200, reply.text
    # A full collection mid-conversion walked its million objects with the GIL held.
    assert collecting == [False]
    assert gc.isenabled()


def test_a_grammar_too_large_to_keep_compiles_off_the_event_loop(live, backend, monkeypatch):
    """A grammar past the compiled-grammar cache's bound was compiled while the request
    was prepared, then again (not kept) on the event loop when it was submitted: for a
    956 KB grammar, /health waited half a second."""
    import asyncio

    from spnl_backend.constrain import grammar

    monkeypatch.setattr(grammar, "COMPILED_KEPT_BYTES", 0)  # nothing is kept
    on_the_loop: list[bool] = []
    compile_spec = grammar.GrammarCompiler.compile

    def watched(self, spec):
        try:
            asyncio.get_running_loop()
            on_the_loop.append(True)
        except RuntimeError:
            on_the_loop.append(False)
        return compile_spec(self, spec)

    monkeypatch.setattr(grammar.GrammarCompiler, "compile", watched)
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "guided_grammar": _chain(3)}
    reply = live.post("/v1/completions", body)
    assert reply.status_code == 200, reply.text
    assert on_the_loop
    assert not any(on_the_loop)

    async def generated():
        return await backend.agenerate("x", max_tokens=2, regex="[a-z]+")

    on_the_loop.clear()
    asyncio.run(generated())
    assert on_the_loop
    assert not any(on_the_loop)


def test_a_grammar_that_does_not_compile_gives_its_places_back(live):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "guided_grammar": 'start: "a" b'}
    reply = live.post("/v1/completions", body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "guided_grammar"
    assert live.state.in_flight == 0


# ---- a constrained output is never cut by a stop --------------------------------------

OBJECT = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


@pytest.mark.parametrize(
    "stops", [{"stop": [", "]}, {"stop": '"'}, {"stop_token_ids": [0]}], ids=str
)
@pytest.mark.parametrize(
    "constraint",
    [
        {"guided_json": OBJECT},
        _schema_format(OBJECT),
        {"response_format": {"type": "json_object"}},
        {"guided_regex": "[a-z]+"},
        {"guided_choice": ["yes", "no"]},
    ],
    ids=["guided_json", "json_schema", "json_object", "regex", "choice"],
)
def test_a_stop_with_a_constraint_is_a_400(live, constraint, stops):
    reply = _post(live, {**constraint, **stops, "max_tokens": 4})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert "cannot be combined with a constrained output" in error["message"]
    assert error["param"] == next(iter(constraint))


def test_a_stop_with_a_tool_call_grammar_is_a_400(live):
    tool = {"type": "function", "function": {"name": "f", "parameters": OBJECT}}
    body = {"tools": [tool], "tool_choice": "required", "stop": ["}"], "max_tokens": 4}
    reply = _post(live, body)
    assert reply.status_code == 400, reply.text
    assert "tool-call grammar" in reply.json()["error"]["message"]


def test_the_python_api_refuses_a_stop_with_a_constraint(backend):
    from spnl_backend.errors import RequestError

    with pytest.raises(RequestError, match=r"stop cannot be combined .* JSON schema"):
        backend.generate("x", max_tokens=4, json_schema=OBJECT, stop=", ")
    with pytest.raises(RequestError, match=r"stop_token_ids cannot be combined .* regex"):
        backend.generate("x", max_tokens=4, regex="[a-z]+", stop_token_ids=[0])
    assert backend.generate("x", max_tokens=4, stop=", ").finish_reason in ("stop", "length")


# ---- the compiled-grammar cache: bounded by the bytes its grammars hold --------------


def _choices(count: int, width: int) -> list[str]:
    return [f"{i:0{width}d}" for i in range(count)]


def test_the_compiled_grammar_cache_is_bounded_by_bytes(backend, monkeypatch):
    from spnl_backend.constrain import grammar
    from spnl_backend.constrain.spec import choice_spec

    compiler = backend._grammars
    compiler.clear()
    specs = [choice_spec(_choices(100, 4 + i)) for i in range(4)]
    size = max(len(spec.grammar) for spec in specs) * grammar.SMALL_BYTES_PER_CHAR
    monkeypatch.setattr(grammar, "COMPILED_KEPT_BYTES", 2 * size + 1)
    for spec in specs:
        compiler.compile(spec)
        count, held = compiler.kept()
        assert held <= 2 * size + 1
    assert count == 2  # the two most recent
    assert list(compiler._compiled) == specs[2:]
    huge = choice_spec(_choices(300, 8))
    assert len(huge.grammar) * grammar.SMALL_BYTES_PER_CHAR > 2 * size + 1
    constraint = compiler.compile(huge)  # compiled for its request, not kept
    assert constraint.matcher is not None
    assert compiler.kept() == (count, held)


def _alternatives(count: int, tag: str) -> str:
    return "(" + "|".join(f"{tag}{i:05d}" for i in range(count)) + ")"


@pytest.mark.skipif(heap_in_use() is None, reason="the heap is measured where glibc's is")
def test_a_large_grammar_is_kept_by_the_bytes_it_was_measured_to_hold(backend, monkeypatch):
    """Counted by its text, a literal regex of 900,000 characters held 203 MB against a
    bound said to keep about 100 MB."""
    from spnl_backend.constrain import grammar
    from spnl_backend.constrain.spec import regex_spec

    compiler = backend._grammars
    compiler.clear()
    monkeypatch.setattr(grammar, "LARGE_GRAMMAR_CHARS", 0)  # every grammar measured
    first = regex_spec(_alternatives(3000, "a"))
    compiler.compile(first)
    _, held = compiler.kept()
    assert held > len(first.grammar)  # measured: more than its text
    bound = 2 * held + held // 2
    monkeypatch.setattr(grammar, "COMPILED_KEPT_BYTES", bound)
    for tag in "bcdef":
        compiler.compile(regex_spec(_alternatives(3000, tag)))
        count, kept = compiler.kept()
        assert kept <= bound
        assert kept == sum(compiled.bytes for compiled in compiler._compiled.values())
    assert count < 6


def test_a_grammar_that_would_hold_too_much_is_a_400(live, backend, monkeypatch):
    from spnl_backend.constrain import grammar

    monkeypatch.setattr(grammar, "LARGE_GRAMMAR_CHARS", 1_000)
    monkeypatch.setattr(grammar, "MAX_COMPILED_BYTES", 1_000)  # below any large one's text
    backend._grammars.clear()
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    reply = live.post("/v1/completions", {**body, "guided_regex": _alternatives(300, "z")})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert "the regex is too large: compiled, it holds" in error["message"]
    assert "at most 0 MiB is accepted" in error["message"]
    assert error["param"] == "guided_regex"
    assert backend._grammars.kept() == (0, 0)
    small = live.post("/v1/completions", {**body, "guided_regex": "[a-z]+"})
    assert small.status_code == 200, small.text  # a small one is not measured nor refused


def test_large_grammars_compile_one_at_a_time(backend, monkeypatch):
    """Eight ~1 MB regexes compiling at once grew the process by 1.2 GB (each compile
    takes about twice what it keeps), and held the cores from everything else."""
    from spnl_backend.constrain import grammar
    from spnl_backend.constrain.spec import regex_spec

    monkeypatch.setattr(grammar, "LARGE_GRAMMAR_CHARS", 0)
    backend._grammars.clear()
    backend.prepare_constraints()
    compiling, most = [0], [0]
    count = threading.Lock()
    compile_spec = grammar.GrammarCompiler._compile

    def watched(self, spec):
        with count:
            compiling[0] += 1
            most[0] = max(most[0], compiling[0])
        try:
            time.sleep(0.05)  # long enough for the others to arrive, were they let in
            return compile_spec(self, spec)
        finally:
            with count:
                compiling[0] -= 1

    monkeypatch.setattr(grammar.GrammarCompiler, "_compile", watched)
    specs = [regex_spec(f"[a-z]{{{n}}}") for n in range(1, 5)]
    threads = [threading.Thread(target=backend._grammars.compile, args=(s,)) for s in specs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert backend._grammars.kept()[0] == 4
    assert most[0] == grammar.LARGE_COMPILES_AT_ONCE == 1


def test_close_releases_the_compiled_grammars(tiny):
    from spnl_backend.constrain.spec import regex_spec

    backend = served_backend(tiny)
    backend.generate("x", max_tokens=2, regex="[a-z]+")
    compiler = backend._grammars
    compiler.compile(regex_spec("[0-9]+"))
    assert compiler.kept()[0] == 2
    backend.close()
    assert compiler.kept() == (0, 0)
    assert compiler._tokenizer is None


def test_a_served_model_has_its_vocabulary_view_built_before_it_serves(tiny):
    # Built on the first constrained request, it held the GIL for seconds mid-service.
    from helpers import CPU

    from spnl_backend.server.run import _served_backend

    frozen = gc.get_freeze_count()
    backend = _served_backend(str(tiny.hf("llama").path), CPU)
    try:
        assert backend._grammars._tokenizer is not None
        # ... and what it loaded kept out of the collector's passes (250 ms each)
        assert gc.get_freeze_count() > frozen
    finally:
        backend.close()
        gc.unfreeze()


def test_masks_are_filled_without_importing_llguidance_torch(tiny):
    """llguidance.torch torch.compiles a kernel as it is imported: seconds with the GIL
    held, which the first constrained request spent stalling the server."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from spnl_backend import BackendSettings, load_backend\n"
        f"backend = load_backend({str(tiny.hf('llama').path)!r}, "
        "BackendSettings(device='cpu'))\n"
        "backend.generate('x', max_tokens=2, regex='[a-z]+')\n"
        "print('llguidance.torch' in sys.modules)\n"
        "backend.close()\n"
    )
    argv = [sys.executable, "-c", script]
    run = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "False"


def test_large_gbnf_grammars_convert_one_at_a_time(monkeypatch):
    """Eight 8,000-rule grammars converting at once (Python, holding the GIL) kept a
    server's event loop from running: /health took 0.2-0.5 s."""
    from spnl_backend.constrain import spec as spec_module

    monkeypatch.setattr(spec_module, "LARGE_SOURCE_CHARS", 0)
    converting, most = [0], [0]
    count = threading.Lock()
    convert = spec_module.to_lark

    def watched(text):
        with count:
            converting[0] += 1
            most[0] = max(most[0], converting[0])
        try:
            time.sleep(0.05)  # long enough for the others to arrive, were they let in
            return convert(text)
        finally:
            with count:
                converting[0] -= 1

    monkeypatch.setattr(spec_module, "to_lark", watched)
    grammars = [f'root ::= "a{i}"' for i in range(4)]
    threads = [threading.Thread(target=spec_module.grammar_spec, args=(g,)) for g in grammars]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert most[0] == 1
