import json, sys, os
from pathlib import Path
run, kind = Path(sys.argv[1]), sys.argv[2]
c4 = run / "checkpoints" / "step_000004"
def st(f):
    p = c4 / "state.json"; d = json.loads(p.read_text()); f(d); p.write_text(json.dumps(d))
if kind == "pg_empty": st(lambda d: d["optimizer"].__setitem__("param_groups", []))
elif kind == "pg_null": st(lambda d: d["optimizer"].__setitem__("param_groups", None))
elif kind == "pg_lr_str": st(lambda d: d["optimizer"]["param_groups"][0].__setitem__("lr", "abc"))
elif kind == "pg_badname": st(lambda d: d["optimizer"]["param_groups"][0]["params"].__setitem__(0, "no.such.param"))
elif kind == "opt_null": st(lambda d: d.__setitem__("optimizer", None))
elif kind == "state_null": (c4 / "state.json").write_text("null")
elif kind == "state_list": (c4 / "state.json").write_text("[1, 2]")
elif kind == "step_str": st(lambda d: d.__setitem__("step", "four"))
elif kind == "step_neg": st(lambda d: d.__setitem__("step", -3))
elif kind == "state_trunc": (c4 / "state.json").write_text((c4 / "state.json").read_text()[:200])
elif kind == "sched_null": st(lambda d: d.__setitem__("scheduler", None))
elif kind == "sched_lambdas_str": st(lambda d: d["scheduler"].__setitem__("last_epoch", "x"))
elif kind == "policy_trunc":
    p = c4 / "policy.safetensors"; b = p.read_bytes(); p.write_bytes(b[: len(b) // 2])
elif kind == "anchor_100":
    p = c4 / "anchor.safetensors"; b = p.read_bytes(); p.write_bytes(b[:100])
elif kind == "opt_empty": (c4 / "optimizer.safetensors").write_bytes(b"")
elif kind == "policy_header_garbage":
    p = c4 / "policy.safetensors"; b = bytearray(p.read_bytes()); b[8:40] = b"{" * 32; p.write_bytes(bytes(b))
elif kind == "policy_header_huge":
    p = c4 / "policy.safetensors"; b = bytearray(p.read_bytes()); b[0:8] = (2**62).to_bytes(8, "little"); p.write_bytes(bytes(b))
elif kind == "both_trunc":
    for s in ("step_000002", "step_000004"):
        p = run / "checkpoints" / s / "policy.safetensors"; b = p.read_bytes(); p.write_bytes(b[: len(b) // 3])
elif kind == "latest_dir":
    (run / "checkpoints" / "latest").unlink(); (run / "checkpoints" / "latest").mkdir()
elif kind == "latest_null": (run / "checkpoints" / "latest").write_text("null")
elif kind == "latest_list": (run / "checkpoints" / "latest").write_text('["step_000004"]')
elif kind == "latest_int": (run / "checkpoints" / "latest").write_text('{"checkpoint": 4, "step": 4}')
elif kind == "latest_traversal": (run / "checkpoints" / "latest").write_text('{"checkpoint": "../../V1/checkpoints/step_000004", "step": 4}')
elif kind == "latest_missing_step": (run / "checkpoints" / "latest").write_text('{"checkpoint": "step_000009", "step": 9}')
elif kind == "metrics_nonutf8":
    p = run / "metrics.jsonl"; lines = p.read_bytes().split(b"\n"); lines[1] = lines[1][:20] + b"\xff" + lines[1][20:]; p.write_bytes(b"\n".join(lines))
elif kind == "metrics_nonutf8_last":
    p = run / "metrics.jsonl"; p.write_bytes(p.read_bytes() + b"\xff\xfe garbage\n")
elif kind == "config_null": (run / "config.yaml").write_text("null\n")
elif kind == "resumes_garbage": (run / "resumes.jsonl").write_bytes(b"\xff\x00{not json\n")
elif kind == "heldout_ids_null": (run / "outcomes" / "heldout.ids.json").write_text("null")
elif kind == "outcomes_garbage": (run / "outcomes" / "outcomes.jsonl").write_bytes(b'{"step": "x"}\n\xff\n')
elif kind == "outcomes_badtype": (run / "outcomes" / "outcomes.jsonl").write_text('{"step": "x", "set": "heldout"}\nnull\n[1]\n')
elif kind == "eval_json_null": (run / "eval.json").write_text("null")
elif kind == "finished_list": (run / "finished.json").write_text("[]")
else: raise SystemExit("unknown " + kind)
print("damaged", run, kind)
