"""Runs under whichever transformers is first on sys.path (the 4.57 side install, or the venv's 5.x):
loads model folders as verl's workers do (AutoModelForCausalLM, + PeftModel for an adapter, fp32, CPU)
and their tokenizers, and writes what they compute.

    python tf4_child.py JOB.json OUT_DIR
JOB: {"models": {name: {"dir": ..., "adapter": optional}}, "ids": [[int]], "tokenizer": dir,
      "texts": [str], "chats": [[{role, content}]]}
OUT_DIR/logits.safetensors: "<name>/<i>" -> [T, V] fp32 logits of ids[i]; or OUT_DIR/result.json "errors"
OUT_DIR/result.json: transformers version, tokenizer class, ids of each text, chat-template text and ids
"""
from __future__ import annotations

import json
import sys
from pathlib import Path


def logits(models: dict, ids: list[list[int]]) -> tuple[dict, dict]:
    import torch
    from transformers import AutoModelForCausalLM

    out, errors = {}, {}
    for name, m in models.items():
        try:
            model = AutoModelForCausalLM.from_pretrained(m["dir"], dtype=torch.float32)
            if m.get("adapter"):
                from peft import PeftModel

                model = PeftModel.from_pretrained(model, m["adapter"])
            model.eval()
            with torch.no_grad():
                for i, seq in enumerate(ids):
                    out[f"{name}/{i}"] = model(torch.tensor([seq])).logits[0].contiguous()  # [T, V]
        except Exception as e:  # reported, not raised: the parent says which folder failed and why
            errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    return out, errors


def tokenize(tok_dir: str, texts: list[str], chats: list[list[dict]]) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    ids = [tok(t).input_ids for t in texts]
    rendered = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    chat_ids = [list(tok(r, add_special_tokens=False).input_ids) for r in rendered]
    direct = [tok.apply_chat_template(c, tokenize=True, add_generation_prompt=True) for c in chats]
    direct = [list(d["input_ids"] if hasattr(d, "keys") else d) for d in direct]  # 5.x: a BatchEncoding
    return {"chat_template_ids": direct,"class": type(tok).__name__, "ids": ids, "decoded": [tok.decode(i) for i in ids], "chat_text": rendered,
            "chat_ids": chat_ids, "special": {"eos": tok.eos_token, "pad": tok.pad_token, "bos": tok.bos_token}}


def main(job_path: str, out_dir: str) -> None:
    import transformers
    from safetensors.torch import save_file

    job = json.loads(Path(job_path).read_text())
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors, errors = logits(job["models"], job["ids"])
    save_file(tensors, str(out / "logits.safetensors"))
    res = {"transformers": transformers.__version__, "errors": errors}
    try:
        res["tokenizer"] = tokenize(job["tokenizer"], job["texts"], job["chats"])
    except Exception as e:
        res["tokenizer_error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    (out / "result.json").write_text(json.dumps(res))


if __name__ == "__main__":
    main(*sys.argv[1:3])
