"""What a response says about its structured output: which schema keywords the grammar did
not enforce, and whether the finished output validates against the full schemas.

    report = output_report(prompt.constraint, parsed.content, parsed.tool_calls, finish)  # None: no JSON schema applied
    body["structured_output"] = report     # beside usage; in streams, on the last chunk / event
    headers(report)                        # {"X-Structured-Output": "relaxed; valid=true"}

`valid` is true or false, or null when the validator could not check (a `$ref` it cannot
resolve, a pattern Python's `re` rejects); `errors` says why. An output cut by the token
limit is not valid: its JSON is unfinished.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional

from fastapi.responses import JSONResponse

from mtp_serve.server.schema_relax import ServedSchema

HEADER = "X-Structured-Output"


def _check(served: Dict[str, ServedSchema], tool_calls: bool, content: Optional[str], calls: List[dict],
           finish: str) -> tuple:
    """(valid, errors) of a finished output."""
    if finish == "length":
        return False, ["the output was cut at the token limit (finish_reason length) before its JSON was complete"]
    if not tool_calls:
        try:
            instance = json.loads(content or "")
        except ValueError as e:
            return False, [f"the output is not JSON: {e}"]
        return _validate(served[""], instance, "")
    if not calls:
        return False, ["the output holds no tool call"]
    errors: List[str] = []
    valid: Optional[bool] = True
    for i, call in enumerate(calls):
        fn = call.get("function") or {}
        name = fn.get("name", "")
        if name not in served:
            valid, errors = False, errors + [f"tool_calls[{i}]: no tool named {name!r}"]
            continue
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except ValueError as e:
            valid, errors = False, errors + [f"tool_calls[{i}] {name}: arguments are not JSON: {e}"]
            continue
        ok, errs = _validate(served[name], args, f"tool_calls[{i}] {name}: ")
        errors += errs
        valid = None if ok is None or valid is None else (valid and ok)
    return valid, errors


def _validate(served: ServedSchema, instance: Any, prefix: str) -> tuple:
    try:
        errors = served.validate(instance)
    except Exception as e:  # noqa: BLE001  (an unresolvable $ref, a pattern `re` rejects: the validator's own failures)
        return None, [f"{prefix}the validator could not check the output: {type(e).__name__}: {str(e)[:200]}"]
    return not errors, [prefix + m for m in errors]


def output_report(constraint: Any, content: Optional[str], calls: List[dict], finish: Optional[str]) -> Optional[dict]:
    """The `structured_output` field of a response whose constraint came from JSON schemas."""
    served: Optional[Dict[str, ServedSchema]] = getattr(constraint, "served", None)
    if served is None or finish is None:
        return None
    valid, errors = _check(served, constraint.tool_calls, content, calls, finish)
    several = list(served) != [""]
    relaxed = [f"{name}:{p}" if several else p for name, s in served.items() for p in s.relaxed]
    ignored = [f"{name}:{p}" if several else p for name, s in served.items() for p in s.ignored]
    return {"mode": constraint.mode, "exact": not relaxed, "relaxed": relaxed, "ignored": ignored,
            "valid": valid, "errors": errors}


def headers(report: Optional[dict]) -> Dict[str, str]:
    if report is None:
        return {}
    valid = {True: "true", False: "false", None: "unknown"}[report["valid"]]
    return {HEADER: f"{'exact' if report['exact'] else 'relaxed'}; valid={valid}"}


def field(report: Optional[dict]) -> Dict[str, dict]:
    """The report as the top-level field a body or a stream's last event carries; {} without one."""
    return {} if report is None else {"structured_output": report}


def respond(body: dict, report: Optional[dict]):
    """A non-streamed body: with the report beside usage and in the header when there is one."""
    if report is None:
        return body
    body["structured_output"] = report
    return JSONResponse(body, headers=headers(report))
