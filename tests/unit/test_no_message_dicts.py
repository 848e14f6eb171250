"""Every message between the driver and its workers is a type of the wire package (nbdist/wire): no module
outside it builds a message as a dict or reads a received one by key or array position."""
from __future__ import annotations

import ast
from pathlib import Path

import nbdist

ROOT = Path(nbdist.__file__).parent
WIRE = ROOT / "wire"
# protocol.Message's fields: a received message's JSON body and its arrays, read only by the wire's types.
RAW_FIELDS = {"body", "arrays"}


def message_dict_uses(source: str) -> list[tuple[int, str]]:
    """(line, what) for each place ``source`` builds or reads a message as a dict."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == "type" for k in node.keys):
            found.append((node.lineno, 'a dict with a "type" key'))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict" \
                and any(k.arg == "type" for k in node.keywords):
            found.append((node.lineno, "dict(type=...)"))
        elif isinstance(node, ast.Attribute) and node.attr in RAW_FIELDS:
            found.append((node.lineno, f"a received message's .{node.attr}"))
        elif isinstance(node, ast.Subscript) and _is_body(node.value) and isinstance(node.slice, ast.Constant) \
                and isinstance(node.slice.value, str):
            found.append((node.lineno, "a body read by key"))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in ("get", "pop") and _is_body(node.func.value):
            found.append((node.lineno, f"a body read by .{node.func.attr}()"))
        elif isinstance(node, ast.Name) and node.id == "MessageType" \
                or isinstance(node, ast.alias) and node.name == "MessageType":
            found.append((node.lineno, "MessageType (dispatch on the message's class instead)"))
    return found


def _is_body(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id in ("body", "reply", "msg", "message", "hello")


def test_no_module_outside_the_wire_builds_or_reads_a_message_dict() -> None:
    offenders = []
    for path in sorted(ROOT.rglob("*.py")):
        if WIRE in path.parents:
            continue
        for line, what in message_dict_uses(path.read_text()):
            offenders.append(f"{path.relative_to(ROOT.parent)}:{line}: {what}")
    assert not offenders, "messages are wire types (nbdist/wire/reports.py, commands.py):\n" + "\n".join(offenders)


def test_the_scan_finds_each_way_back_to_a_dict() -> None:
    # What the code did before the messages were typed: each form is caught, and the typed form is not.
    old = {
        'link.send({"type": MessageType.WARNING, "message": warning})': 2,  # the dict and MessageType
        'self._coordinator.send(0, dict(type="stop", weights=True))': 1,
        'n = int(msg.body["n_weights"])': 1,
        'text = str(msg.body.get("message", ""))': 1,
        "rank = body.get('rank')": 1,
        "epoch = int(body['epoch'])": 1,
        "y_row = answers[0].arrays[n_state]": 1,
        "if msg.type == MessageType.DONE: pass": 1,
    }
    for line, count in old.items():
        assert len(message_dict_uses(line)) == count, line
    new = ["link.send(WorkerWarning(warning))", "self._last_weights = (msg.epoch, msg.weights, len(msg.optimizer))",
           "if isinstance(msg, Done): pass", 'if cell.get("type") == 1: pass', 'info = {"kind": "multiclass"}',
           "x = batch['x']", "head = message[:1000]"]
    for line in new:
        assert not message_dict_uses(line), line
