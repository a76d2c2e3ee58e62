"""GBNF (llama.cpp's grammar syntax) to Lark (llguidance's), in time linear in the grammar.

llguidance's converter parses GBNF well, but it finds the terminals (rules that reach only
literals and character classes, written in upper case so that Lark lexes them) by sweeping
every rule until a sweep changes nothing: along a chain of rules one rule per sweep, so
8,000 chained rules took 104 s. Here its parser reads the grammar and the terminals are
found in one pass over a worklist; the Lark text written is the same as its converter's.
"""

import re
from collections import defaultdict
from collections.abc import Iterator

from ..errors import RequestError

START = "start"  # Lark's first rule; GBNF's is ``root``


def to_lark(text: str) -> str:
    """``text`` in Lark's syntax: as it is where it is Lark already, else converted from
    GBNF. A grammar that does not parse or link is a `RequestError` saying where."""
    from llguidance.gbnf_to_lark import GbnfToLarkError, GrammarParser, is_lark_syntax

    if is_lark_syntax(text):
        return text
    try:
        rules = GrammarParser().parse(text)
    except GbnfToLarkError as exc:
        raise RequestError(f"grammar: {exc}") from None
    ordered = list(rules.values())
    for order, rule in enumerate(ordered):
        rule.alternatives = rule.alternatives.simplify()
        rule.order = order
    refs = {id(rule): list(_references(rule)) for rule in ordered}
    _link(rules, refs)
    _mark_terminals(ordered, refs)
    _rename(ordered)
    return _written(ordered)


def _references(rule: object) -> Iterator[object]:
    """Every rule reference inside ``rule``, walked without recursion."""
    from llguidance.gbnf_to_lark import RuleRefNode

    stack = list(rule.children())  # type: ignore[attr-defined]
    while stack:
        node = stack.pop()
        if isinstance(node, RuleRefNode):
            yield node
        stack.extend(node.children())


def _link(rules: dict, refs: dict[int, list]) -> None:
    """Each reference (``refs``: each rule's, by the rule's id) pointed at its rule;
    ``root`` becomes Lark's ``start``."""
    for rule in rules.values():
        for ref in refs[id(rule)]:
            target = rules.get(ref.name)  # type: ignore[attr-defined]
            if target is None:
                raise RequestError(f"grammar: rule {ref.name!r} is used but never defined")  # type: ignore[attr-defined]
            ref.target = target  # type: ignore[attr-defined]
    root = rules.get("root")
    if root is None:
        raise RequestError("grammar: a GBNF grammar needs a 'root' rule (where output starts)")
    if START in rules:
        raise RequestError(f"grammar: a GBNF rule may not be named {START!r} beside 'root'")
    root.name = START


def _mark_terminals(ordered: list, refs: dict[int, list]) -> None:
    """A rule other than ``start`` is a terminal when every rule it uses is one (so a rule
    on a cycle never is): each rule counts the uses still unresolved, and a rule whose
    count reaches zero is marked and lowers the counts of the rules that use it. (Rules
    are compared by identity: the parser's nodes are unhashable dataclasses.)"""
    unresolved: dict[int, int] = {}
    users: defaultdict[int, list[object]] = defaultdict(list)
    for rule in ordered:
        unresolved[id(rule)] = len(refs[id(rule)])
        for ref in refs[id(rule)]:
            users[id(ref.target)].append(rule)
    ready = [rule for rule in ordered if unresolved[id(rule)] == 0]
    while ready:
        rule = ready.pop()
        if rule.name == START:
            continue
        rule.rule_is_terminal = True
        for user in users[id(rule)]:
            unresolved[id(user)] -= 1
            if unresolved[id(user)] == 0:
                ready.append(user)


def _rename(ordered: list) -> None:
    """Lark's names: ``-`` to ``_``, camelCase to snake_case, terminals in upper case."""
    names = set()
    for rule in ordered:
        name = re.sub(r"([a-z])([A-Z])", r"\1_\2", rule.name.replace("-", "_"))
        name = name.upper() if rule.rule_is_terminal else name.lower()
        if name in names:
            raise RequestError(
                f"grammar: two rules are both named {name!r} once written in Lark's syntax "
                f"(where '-' is '_', case folds and camelCase is snake_case)"
            )
        names.add(name)
        rule.name = name


def _written(ordered: list) -> str:
    """The rules in their GBNF order; a rule over several lines set apart by blank lines."""
    parts = ["%llguidance {}\n\n"]
    apart = True
    for rule in ordered:
        text = str(rule)
        several = "\n" in text
        if several and not apart:
            parts.append("\n")
        parts.append(text + "\n")
        if several:
            parts.append("\n")
        apart = several
    return "".join(parts)
