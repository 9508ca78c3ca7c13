"""tools/evaluate.py and its lm-eval adapter (megatron/md/evaluation); tools/export_hf.py.

In-process: the adapter's scoring against direct sums over small causal models (a bigram
table, whose windows can be checked token by token, and a prefix-mean model, which sees the
whole context, so padding or truncation mistakes change its numbers), and a multiple-choice task
through lm-eval's own evaluator. End to end: a tiny AdamMD run on a BPE corpus, evaluated from
its checkpoint: the adapter's loss on the run's validation samples equals the validation loss
the run logged, a local multiple-choice task writes its JSON, and the Hugging Face export
gives megatron's logits."""

import csv
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.md.evaluation.harness import MegatronLM

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tools"), str(ROOT / "examples" / "md_decoupling")]
V, EOD = 32, 0


def env() -> dict:
    """The launches' environment, read when they start: os.environ as tests/conftest.py restores
    it (without what an import set at collection, which would start the ranks afresh)."""
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def bigram(seed=0):
    table = torch.randn(V, V, generator=torch.Generator().manual_seed(seed))
    return table, (lambda tokens: table[tokens])


def prefix_mean(seed=1):
    """logits at position i from the mean embedding of tokens 0..i (causal, context-wide)."""
    g = torch.Generator().manual_seed(seed)
    emb, out = torch.randn(V, 8, generator=g), torch.randn(8, V, generator=g)

    def forward(tokens):
        e = emb[tokens].cumsum(1) / torch.arange(1, tokens.shape[1] + 1)[None, :, None]
        return e @ out

    return forward


def direct(forward, ctx, cont):
    """log p(cont | ctx) from one unbatched, unpadded forward pass."""
    ids = torch.tensor([ctx + cont[:-1]])
    logp = torch.log_softmax(forward(ids).float(), -1)[0]
    return sum(logp[len(ctx) - 1 + j, t].item() for j, t in enumerate(cont))


def encode(text):  # characters → ids 1..V-1 (0 is eod)
    return [1 + ord(c) % (V - 1) for c in text]


def test_rolling_windows_score_every_token_once():
    """A 50-token text in windows of 16: with a bigram model every token's log-probability
    depends only on its predecessor, so the rolling sum must equal the plain sum with the eod
    first; a dropped or doubled token changes it."""
    table, fwd = bigram()
    tokens = torch.randint(1, V, (50,), generator=torch.Generator().manual_seed(3)).tolist()
    lm = MegatronLM(fwd, encode, EOD, max_length=16, batch_size=3)
    logp = torch.log_softmax(table, -1)
    want = sum(logp[p, t].item() for p, t in zip([EOD] + tokens[:-1], tokens))
    assert lm.rolling(tokens) == pytest.approx(want, rel=1e-6)
    assert lm.rolling(tokens, prefix=5) == pytest.approx(
        want - logp[EOD, tokens[0]].item() + logp[5, tokens[0]].item(), rel=1e-6
    )


def test_batched_scores_equal_one_at_a_time_and_keep_their_order():
    """Requests of different lengths batched longest first with right padding: each score equals
    its own unpadded forward pass (a model that reads the whole prefix would see any padding
    or offset), answers come back in input order, greedy flags are right."""
    fwd = prefix_mean()
    g = torch.Generator().manual_seed(4)
    pairs = [(torch.randint(1, V, (n,), generator=g).tolist(),
              torch.randint(1, V, (m,), generator=g).tolist())
             for n, m in [(3, 2), (9, 1), (1, 5), (6, 6), (2, 1)]]  # fmt: skip
    got = MegatronLM(fwd, encode, EOD, max_length=64, batch_size=2).score(pairs)
    for (ctx, cont), (s, greedy) in zip(pairs, got):
        assert s == pytest.approx(direct(fwd, ctx, cont), rel=1e-5, abs=1e-5)
        ids = torch.tensor([ctx + cont[:-1]])
        pred = fwd(ids)[0, len(ctx) - 1 :].argmax(-1).tolist()
        assert greedy == (pred == cont)
    greedy_cont = [fwd(torch.tensor([[7, 3]]))[0, -1].argmax().item()]
    assert MegatronLM(fwd, encode, EOD, 64).score([([7, 3], greedy_cont)])[0][1] is True


def test_an_input_is_read_once_and_its_prefixes_from_it():
    """Requests whose model input (context + continuation less its last token) is another's, or
    begins another's, are scored from one read of the longest: a multiple-choice question with
    single-token choices (MMLU's " A" … " D") is one row, not four; a choice of one token reads
    nothing the other choices' rows did not. Every score equals its own unbatched, unpadded
    forward pass (the model reads the whole prefix, so a wrong position would show)."""
    fwd = prefix_mean()
    g = torch.Generator().manual_seed(5)
    questions = [torch.randint(1, V, (n,), generator=g).tolist() for n in (4, 7, 2, 9, 5)]
    mmlu = [(q, [c]) for q in questions for c in (11, 12, 13, 14)]
    lm = MegatronLM(fwd, encode, EOD, max_length=64, batch_size=3)
    got = lm.score(mmlu)
    assert lm.rows_read == 5  # one per question
    for (ctx, cont), (s, _) in zip(mmlu, got):
        assert s == pytest.approx(direct(fwd, ctx, cont), rel=1e-5, abs=1e-5)
    # a one-token choice inside the others' rows; a duplicate; a choice that extends another;
    # a continuation that starts where another context ends; unrelated requests
    ctx = [3, 1, 4, 1, 5]
    pairs = [(ctx, [9]), (ctx, [9, 2, 6]), (ctx, [9, 2]), (ctx, [9, 2, 6]), (ctx + [9], [2, 6]),
             (ctx, [8, 8]), ([2, 7], [1]), ([2, 7, 1, 8], [2])]  # fmt: skip
    lm = MegatronLM(fwd, encode, EOD, max_length=64, batch_size=2)
    got = lm.score(pairs)
    assert lm.rows_read == 3  # ctx+[9,2], ctx+[8], [2,7,1,8]
    for (c, cont), (s, greedy) in zip(pairs, got):
        assert s == pytest.approx(direct(fwd, c, cont), rel=1e-5, abs=1e-5)
        pred = fwd(torch.tensor([c + cont[:-1]]))[0, len(c) - 1 :].argmax(-1).tolist()
        assert greedy == (pred == cont)


def test_long_requests_keep_the_last_max_length_tokens():
    """Context + continuation over max_length: the model reads the last max_length tokens and
    scores the continuation (its tail where it alone is longer)."""
    fwd = prefix_mean()
    ctx, cont = list(range(1, 21)), [5, 6, 7]
    lm = MegatronLM(fwd, encode, EOD, max_length=8)
    whole = (ctx + cont)[-9:]
    assert lm.score([(ctx, cont)])[0][0] == pytest.approx(direct(fwd, whole[:-3], cont), rel=1e-5)
    long_cont = list(range(1, 13))
    tail = long_cont[-8:]
    want = direct(fwd, long_cont[-9:-8], tail)
    assert lm.score([([3], long_cont)])[0][0] == pytest.approx(want, rel=1e-5)


def test_multiple_choice_task_through_lm_eval(tmp_path):
    """A local multiple-choice task (tools/evaluate.py's JSONL form) run by lm-eval's evaluator on
    a bigram model that prefers one answer's character transitions (lm-eval puts a space
    between question and choice): accuracy 1 with that answer marked right, 0 with the other
    one; generation is refused by name."""
    import evaluate
    import lm_eval
    from lm_eval.tasks import TaskManager

    table = torch.zeros(V, V)
    for a, b in zip(encode(" yes"), encode(" yes")[1:]):
        table[a, b] = 8.0
    table[encode("?")[0], encode(" ")[0]] = 8.0
    lm = MegatronLM(lambda t: table[t], encode, EOD, max_length=64)
    for right, want in ((0, 1.0), (1, 0.0)):
        docs = [{"question": f"Question {i}?", "choices": ["yes", "no"], "answer": right}
                for i in range(4)]  # fmt: skip
        data = tmp_path / f"quiz{right}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        assert evaluate.check_local("quiz", str(data)) == 4
        (tmp_path / f"quiz{right}.yaml").write_text(
            evaluate.local_task_yaml(f"quiz{right}", str(data))
        )
        tasks = TaskManager(include_path=str(tmp_path), include_defaults=False)
        out = lm_eval.simple_evaluate(
            model=lm, tasks=[f"quiz{right}"], bootstrap_iters=0, task_manager=tasks
        )
        assert out["results"][f"quiz{right}"]["acc,none"] == want
    with pytest.raises(NotImplementedError, match=r"generation tasks .*\(tools/export_hf.py"):
        lm.generate_until([])


def test_bad_local_task_is_named_before_anything_is_built(tmp_path):
    import evaluate

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "choices": ["a", "b"], "answer": 0}\n{"question": "q"}\n')
    with pytest.raises(SystemExit, match=r"bad.jsonl:2 is not a document"):
        evaluate.check_local("bad", str(bad))
    with pytest.raises(SystemExit):
        evaluate.parse_args(["--load", str(tmp_path), "--local-task", "x=missing.jsonl"])
    a = evaluate.parse_args(["--load", str(tmp_path), "--tasks", "paper"])
    assert a.tasks == ["mmlu", "hellaswag", "arc_challenge", "arc_easy", "winogrande"]
    for out in (tmp_path, "/proc/md-evals/x.json"):  # a directory; a path nothing can create
        with pytest.raises(SystemExit):
            evaluate.parse_args(["--load", str(tmp_path), "--tasks", "paper", "--out", str(out)])


def test_headline_is_the_papers_metric_per_task():
    """The paper's appendix: length-normalized accuracy for HellaSwag and ARC, plain accuracy
    for MMLU and WinoGrande; the average over the tasks that ran, in %."""
    import evaluate

    res = {t: {"acc": 0.25, "acc_norm": 0.5} for t in evaluate.PAPER_TASKS}
    h = evaluate.headline(res)
    assert h["hellaswag"] == h["arc_easy"] == 50.0 and h["mmlu"] == h["winogrande"] == 25.0
    assert math.isclose(h["average"], (25 + 50 + 50 + 50 + 25) / 5)


def test_tasks_are_checked_before_the_model_is_built(tmp_path):
    """``--tasks`` names lm-eval does not know, and tasks that generate text, are refused with
    the way out named, from the task index alone (no dataset read, no model built), looked for
    as lm-eval 0.4.13 builds them: through groups and tags, a group's overrides of a member,
    inline tasks, and a task naming no output type (lm-eval's default, ``generate_until``);
    multiple-choice tasks and groups of them pass."""
    import evaluate
    from lm_eval.tasks import TaskManager

    quiz = json.loads(evaluate.local_task_yaml("quiz", str(tmp_path / "q.jsonl")))
    gen = {
        **quiz,
        "task": "answer",
        "output_type": "generate_until",
        "generation_kwargs": {"until": ["\n"]},
        "metric_list": [{"metric": "exact_match"}],
        "tag": "answers",
    }
    untyped = {k: v for k, v in gen.items() if k not in ("output_type", "tag")}
    inline = {**untyped, "task": "inline"}
    yamls = {
        "quiz": quiz,
        "answer": gen,
        "untyped": {**untyped, "task": "untyped"},
        "both": {"group": "both", "task": ["quiz", "answer"]},
        "mc": {"group": "mc", "task": ["quiz", {"task": "quiz", "task_alias": "q"}]},
        "tagged": {"group": "tagged", "task": ["answers"]},
        "inl": {"group": "inl", "task": [{"group": "sub", "task": [inline]}]},
        "over": {"group": "over", "task": [{"task": "quiz", "output_type": "generate_until"}]},
        "mcgen": {"group": "mcgen", "task": [{"task": "answer", "output_type": "multiple_choice"}]},
    }
    for name, cfg in yamls.items():
        (tmp_path / f"{name}.yaml").write_text(json.dumps(cfg))
    manager = TaskManager(include_path=str(tmp_path), include_defaults=False)

    def check(*tasks):
        evaluate.check_tasks(evaluate.parse_args(["--load=x", f"--tasks={','.join(tasks)}"]),
                             manager)  # fmt: skip

    check("quiz", "mc", "mcgen")
    with pytest.raises(SystemExit, match=r"no task, group or tag nosuch \(lm_eval --tasks list"):
        check("quiz", "nosuch")
    for asked, gens in ((["answer"], "answer generates"), (["mc", "both"], "answer generates"),
                        (["answers"], "answer generates"), (["tagged"], "answer generates"),
                        (["untyped"], "untyped generates"), (["inl"], "inline generates"),
                        (["over"], "quiz generates"), (["answer", "untyped"],
                                                       "answer, untyped generate")):  # fmt: skip
        with pytest.raises(SystemExit, match=rf"--tasks: {gens} text.*tools/export_hf"):
            check(*asked)


def test_tokenizer_must_encode_text_for_tasks(tmp_path):
    """A run trained with NullTokenizer (ids only) can be scored on its validation set, not on
    text tasks: refused before the model is built."""
    import argparse

    import evaluate

    a = evaluate.parse_args(["--load", str(tmp_path), "--tasks", "arc_easy"])
    with pytest.raises(SystemExit, match="NullTokenizer"):
        evaluate.check_tokenizer(argparse.Namespace(tokenizer_type="NullTokenizer"), a)
    only_valid = evaluate.parse_args(["--load", str(tmp_path), "--valid-loss"])
    evaluate.check_tokenizer(argparse.Namespace(tokenizer_type="NullTokenizer"), only_valid)
    # a run that never evaluated (the paper's MoE runs: --eval-iters 0) has no samples to score
    none = argparse.Namespace(tokenizer_type="NullTokenizer", eval_iters=0)
    with pytest.raises(SystemExit, match=r"evaluated none \(--eval-iters 0\)"):
        evaluate.check_valid_loss(none, only_valid)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-rank ZeRO-1 AdamMD run of the paper architecture on a BPE corpus, 12 iterations,
    saved at 6 and 12, evaluated at 12: (its run directory, the corpus text)."""
    import cpu_demo  # (examples/md_decoupling, on the path above)
    import preprocess_data
    import train_tokenizer

    from megatron.md.launch import local_ranks

    tmp = tmp_path_factory.mktemp("trained")
    text = cpu_demo.TEXT
    docs = tmp / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": text[i : i + 400]}) + "\n"
                            for i in range(0, len(text) - 400, 31)))  # fmt: skip
    train_tokenizer.main(["--input", str(docs), "--vocab-size", "300", "--out", str(tmp / "tok")])
    preprocess_data.main(["--input", str(docs), "--tokenizer-model", str(tmp / "tok"),
                          "--output-prefix", str(tmp / "c"), "--workers", "1"])  # fmt: skip
    run = tmp / "run"
    flags = ["--preset=tiny", "--optimizer=adam", "--md-decoupling", "--lr=1e-2",
             "--use-distributed-optimizer", "--tokenizer-type=HuggingFaceTokenizer",
             f"--tokenizer-model={tmp / 'tok'}", f"--data-path={tmp / 'c_text_document'}",
             "--split=90,10,0", "--seq-length=64", "--max-position-embeddings=64",
             "--micro-batch-size=2", "--global-batch-size=4", "--train-iters=12",
             "--eval-interval=12", "--eval-iters=2", "--log-interval=4", f"--save={run}",
             "--save-interval=6"]  # fmt: skip
    out = subprocess.run(local_ranks(ROOT / "pretrain_gpt.py", 2, flags), capture_output=True,
                         text=True, timeout=600, env=env(), cwd=tmp)  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return run, text


@pytest.mark.distributed
def test_checkpoint_scores_its_own_validation_loss_and_runs_a_task(trained, tmp_path):
    """The run of ``trained`` evaluated from its checkpoints on one process, as a trajectory
    (--trajectory 1/2: iterations 6 and 12, the model built at 6 and 12's weights loaded into
    it): the adapter's mean loss over the samples of the run's evaluation at iteration 12
    equals the validation loss the run logged there (the rebuilt model is the trained one, and
    the reload replaced every weight: a missed Sandwich Norm or embedding scale, or 6's weights,
    move it by far more), a local multiple-choice task writes its metrics to each checkpoint's
    JSON with the training tokens, and a second call finds both written and builds nothing."""
    run, text = trained
    logged = [json.loads(ln) for ln in (run / "metrics.jsonl").open() if '"valid"' in ln][0]
    assert logged["iteration"] == 12
    quiz = tmp_path / "quiz.jsonl"
    quiz.write_text("".join(json.dumps({"question": text[i : i + 80], "choices": [
        text[i + 80 : i + 100], text[i + 300 : i + 320], text[i + 600 : i + 620]], "answer": 0})
        + "\n" for i in range(0, 1500, 300)))  # fmt: skip
    folder = tmp_path / "eval"
    cmd = [sys.executable, str(ROOT / "tools" / "evaluate.py"), f"--load={run}", "--valid-loss",
           f"--local-task=quiz={quiz}", f"--out={folder}", "--batch-size=3",
           "--trajectory=1/2"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env(), cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert sorted(p.name for p in folder.iterdir()) == ["iter_0000006.json", "iter_0000012.json"]
    first, got = (json.loads((folder / f"iter_{i:07d}.json").read_text()) for i in (6, 12))
    assert (first["iteration"], got["iteration"]) == (6, 12) and got["valid"]["samples"] == 8
    assert (first["tokens"], got["tokens"]) == (6 * 4 * 64, 12 * 4 * 64)
    assert got["valid"]["lm loss"] == pytest.approx(logged["lm loss"], rel=1e-5)
    assert first["valid"]["lm loss"] > got["valid"]["lm loss"] * 1.01  # 6 trained less
    assert logged["lm loss"] < 5.0  # trained: below ln(300) = 5.7 for the uniform guess
    for rep in (first, got):
        quiz_metrics = rep["tasks"]["quiz"]
        assert set(quiz_metrics) >= {"acc", "acc_norm"}
        assert all(v * 5 == round(v * 5) and 0 <= v <= 1
                   for v in (quiz_metrics["acc"], quiz_metrics["acc_norm"]))  # fmt: skip
    again = subprocess.run(
        cmd, capture_output=True, text=True, timeout=600, env=env(), cwd=tmp_path
    )
    assert again.returncode == 0 and "(2), 2 of them already in" in again.stdout, again.stdout
    assert "validation loss" not in again.stdout


@pytest.mark.distributed
def test_a_transformer_engine_run_is_evaluated_where_te_does_not_load(trained, tmp_path):
    """A run trained with Transformer Engine (its saved args say so; the checkpoint's keys are
    the ones the local spec writes, which are TE's names: megatron-core's
    ``sharded_state_dict_keys_map``) evaluated where TE does not load: rebuilt with the local
    layer spec, said so, and its validation loss is the one the run logged (without the
    fallback: refused, TE not installed)."""
    import shutil

    from megatron.core import dist_checkpointing

    from megatron.md.evaluation import restore

    run, _ = trained
    te = tmp_path / "te-run"
    shutil.copytree(run, te)
    # the saved args rewritten: megatron-core reads a legacy common.pt before the common state
    # inside the torch_dist files (dist_checkpointing/serialization.py, load_common_state_dict)
    state = dist_checkpointing.load_common_state_dict(str(te / "iter_0000012"))
    state["args"].transformer_impl = "transformer_engine"
    torch.save(state, te / "iter_0000012" / "common.pt")
    saved, _ = restore.saved_args(str(te), 12)
    assert restore.local_for_te(saved) and "--transformer-impl=local" in restore.argv_for(
        saved, str(te), 12, True
    )
    logged = [json.loads(ln) for ln in (run / "metrics.jsonl").open() if '"valid"' in ln][0]
    cmd = [sys.executable, str(ROOT / "tools" / "evaluate.py"), f"--load={te}", "--valid-loss",
           "--batch-size=4"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env(), cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "go into the local layer spec" in out.stdout
    loss = float(re.search(r"validation loss[^0-9]*([0-9.]+)", out.stdout).group(1))
    assert loss == pytest.approx(logged["lm loss"], rel=1e-5)


def test_trajectory_arguments_are_checked(capsys):
    """--trajectory takes a fraction in [0, 1] and a folder --out, and no --ckpt-step."""
    import evaluate

    base = ["--load=x", "--valid-loss"]
    a = evaluate.parse_args([*base, "--trajectory=2/3", "--out=/tmp/evals-folder"])
    assert a.trajectory == pytest.approx(2 / 3)
    cases = (
        (["--trajectory=3/2", "--out=/tmp/e"], "fraction of the run"),
        (["--trajectory=x", "--out=/tmp/e"], "fraction of the run"),
        (["--trajectory=1/2"], "give --out FOLDER"),
        (["--trajectory=1/2", "--out=/tmp/e", "--ckpt-step=4"], "drop --ckpt-step"),
    )
    for bad, why in cases:
        with pytest.raises(SystemExit):
            evaluate.parse_args([*base, *bad])
        assert why in capsys.readouterr().err, bad


def test_replayed_flags_parse_back_to_the_saved_values():
    """Saved args → flags → megatron's parser (with ours) gives the saved values back, for each
    kind of flag: store_true, --no-* (BooleanOptionalAction), a value, a layer pattern list.
    A run without Sandwich Norm saved ``--block-output-scale``'s default, which it never read
    and which is refused without the norm: not replayed (its scale is
    ``--prenorm-block-scale``); nor are nGPT's flags for a GPT run."""
    import argparse

    from megatron.md.evaluation import restore

    saved = argparse.Namespace(hidden_size=96, qk_layernorm=True, swiglu=False,
                               sandwich_norm=False, embedding_scale=True,
                               prenorm_block_scale="1/sqrt(2L)",
                               moe_layer_freq=[1, 0, 1], normalization="RMSNorm",
                               untie_embeddings_and_output_weights=True, use_rope_scaling=True,
                               rope_scaling_factor=4.0)  # fmt: skip
    unread = argparse.Namespace(**vars(saved), block_output_scale="1/L")
    assert restore.replay(unread, set(vars(unread))) == restore.replay(saved, set(vars(saved)))
    gpt = argparse.Namespace(arch="gpt", ngpt_residual_scale="1/sqrt(d)")  # (a default, unread)
    assert restore.replay(gpt, set(vars(gpt))) == ["--arch=gpt"]
    on = argparse.Namespace(sandwich_norm=True, block_output_scale="1")
    assert restore.replay(on, set(vars(on))) == ["--sandwich-norm", "--block-output-scale=1"]
    flags = restore.replay(saved, set(vars(saved)))
    assert "--no-sandwich-norm" in flags and "--moe-layer-freq=[1,0,1]" in flags
    assert {"use_rope_scaling", "rope_scaling_factor"} <= set(restore.ARCH)  # the dense presets'
    assert "--use-rope-scaling" in flags and "--rope-scaling-factor=4.0" in flags
    back, _ = restore._parser().parse_known_args(flags)
    for k, v in vars(saved).items():
        assert getattr(back, k) == v, k


@pytest.mark.distributed
def test_export_to_hugging_face_gives_megatrons_logits(trained, tmp_path):
    """tools/export_hf.py on the run of ``trained``: the folder loads with transformers
    (trust_remote_code) and its logits equal megatron's (--check: relative 1e-4 at most; seen
    3.5e-7 on fp32); greedy generate() is the argmax of full forward passes; the run's
    tokenizer comes along; lm-eval's Hugging Face backend generates from it, a left-padded
    batch as each prompt alone; an existing --out is refused (what the
    HF model cannot compute: test_export_refuses_what_the_hf_model_cannot_compute; an MoE run's
    export: test_pretrain_e2e)."""
    run, text = trained
    out = tmp_path / "hf"
    cmd = [sys.executable, str(ROOT / "tools" / "export_hf.py"), f"--load={run}", f"--out={out}",
           "--check"]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env(), cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rel = float(re.search(r"relative difference (\S+)", res.stdout).group(1))
    assert rel < 1e-5
    names = {p.name for p in out.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "modeling_megatron_md.py",
        "tokenizer.json",
    } <= names
    assert json.loads((out / "megatron_md_export.json").read_text())["iteration"] == 12
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env())
    assert again.returncode != 0 and "exists" in again.stderr
    # generate() reads the whole sequence each step (no key/value cache): greedy decoding is
    # the argmax of each full forward pass (transformers built a cache from the config and
    # failed on its missing num_hidden_layers)
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    ids = torch.tensor([[5, 17, 99, 3]])
    with torch.no_grad():
        got = hf.generate(ids, max_new_tokens=4, do_sample=False)
        for _ in range(4):
            ids = torch.cat([ids, hf(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(got, ids)
    # lm-eval's own Hugging Face backend loads the folder; its generation pads the prompts of
    # a batch on the left: batched, each prompt continues as it does alone
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    until = {"until": ["QQQ"], "max_gen_toks": 6, "do_sample": False}
    reqs = [Instance("generate_until", {}, (text[i : i + n], until), k)
            for k, (i, n) in enumerate(((0, 90), (400, 25), (900, 55)))]  # fmt: skip
    outs = [
        HFLM(
            pretrained=str(out), trust_remote_code=True, batch_size=b, device="cpu"
        ).generate_until(reqs)
        for b in (1, 3)
    ]
    assert outs[0] == outs[1] and len(set(outs[0])) == 3, outs


def test_export_refuses_what_the_hf_model_cannot_compute():
    import argparse

    from megatron.md.export import hf_export

    ok = dict(normalization="RMSNorm", swiglu=True, add_bias_linear=False, num_experts=None)
    assert hf_export.unsupported(argparse.Namespace(**ok)) == []
    moe = argparse.Namespace(**{**ok, "num_experts": 8, "normalization": "LayerNorm"})
    assert hf_export.unsupported(moe) == ["LayerNorm (normalization='LayerNorm')"]
    # flags that reach megatron's model since 2026-11-29 (or through its TransformerConfig)
    # and that the exported model does not compute: its logits would differ, unnamed
    other = argparse.Namespace(**{**ok, "qk_l2_norm": True, "window_size": (8, 0),
                                  "rotary_seq_len_interpolation_factor": 2})  # fmt: skip
    assert hf_export.unsupported(other) == [
        "RoPE position interpolation (rotary_seq_len_interpolation_factor=2)",
        "QK L2 normalization (qk_l2_norm=True)",
        "sliding-window attention (window_size=(8, 0))",
    ]
    # MoE routing the exported router does not compute: token dropping, groups, sinkhorn
    routed = argparse.Namespace(**{**ok, "num_experts": 8, "moe_expert_capacity_factor": 1.0,
                                   "moe_router_num_groups": 4,
                                   "moe_router_load_balancing_type": "sinkhorn"})  # fmt: skip
    assert hf_export.unsupported(routed) == [
        "routing other than top-k (moe_router_load_balancing_type='sinkhorn')",
        "group-limited routing (moe_router_num_groups=4)",
        "token dropping (an expert capacity) (moe_expert_capacity_factor=1.0)",
    ]
    fine = {
        "moe_router_load_balancing_type": "seq_aux_loss",
        "moe_router_score_function": "sigmoid",
    }
    assert hf_export.unsupported(argparse.Namespace(**{**ok, "num_experts": 8, **fine})) == []


def test_exported_moe_names_and_layer_pattern():
    """The MoE layer pattern is megatron's (an int k: experts in every k-th layer from the
    first; a list as given); Transformer Engine's grouped experts (``linear_fc1.weight3``) are
    renamed to the local spec's ``local_experts.3``; a weight the HF model does not have, or of
    another shape, is named before anything is written."""
    import argparse

    from megatron.md.export import hf_export

    def ns(**kw):
        return argparse.Namespace(**{"num_layers": 4, "num_experts": 8, **kw})

    assert hf_export.moe_layers(ns(moe_layer_freq=2)) == [1, 0, 1, 0]
    assert hf_export.moe_layers(ns(moe_layer_freq=[0, 1, 1, 1])) == [0, 1, 1, 1]
    assert hf_export.moe_layers(ns(num_experts=None, moe_layer_freq=1)) == [0, 0, 0, 0]
    w = torch.zeros(2, 2)
    te = {"module.decoder.layers.1.mlp.experts.linear_fc1.weight3": w,
          "decoder.layers.1.mlp.experts.linear_fc2.weight12": w,
          "decoder.layers.1.mlp.experts.linear_fc1._extra_state": None}  # fmt: skip
    assert sorted(hf_export.tensors(te)) == [
        "decoder.layers.1.mlp.experts.local_experts.12.linear_fc2.weight",
        "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight",
    ]
    cfg = dict(vocab_size=16, hidden_size=8, num_layers=2, num_attention_heads=2,
               num_query_groups=1, kv_channels=4, ffn_hidden_size=8, moe_layers=[0, 1],
               num_experts=2, moe_ffn_hidden_size=4, moe_expert_bias=True)  # fmt: skip
    from megatron.md.export import hf_modeling

    full = hf_modeling.MegatronMDForCausalLM(hf_modeling.MegatronMDConfig(**cfg)).state_dict()
    assert hf_export.mismatched(cfg, full) == []
    bad = {k: v for k, v in full.items() if "expert_bias" not in k}
    bad["decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight"] = torch.zeros(8, 2)
    bad["decoder.layers.1.mlp.experts.weight1"] = w
    assert hf_export.mismatched(cfg, bad) == [
        "decoder.layers.1.mlp.router.expert_bias missing",
        "decoder.layers.1.mlp.experts.weight1 not in the HF model",
        "decoder.layers.1.mlp.experts.local_experts.0.linear_fc2.weight: (8, 2) where the HF "
        "model has (8, 4)",
    ]


def test_replayed_args_are_parser_destinations():
    """Every name the evaluation replays from a checkpoint is an argument megatron's (or our)
    parser has: a misspelt one would silently not be replayed."""
    from megatron.md.evaluation import restore

    dests = {a.dest for a in restore._parser()._actions}
    assert set(restore.ARCH) - dests == set() and set(restore.DATA) - dests == set()


def test_exported_rope_scaling_is_megatrons():
    """The exported model's Llama 3.x RoPE scaling gives megatron-core's frequencies
    (RotaryEmbedding with rope_scaling, the dense presets' head dim 128 and base 5e5, and 64 at
    base 1e4) to float32 rounding, and reaches the forward pass: logits at position 0 (angle 0)
    are unchanged, later ones differ; the export's config carries the factor where the run
    scaled, and nothing refuses it."""
    import argparse

    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron.md.export import hf_export, hf_modeling

    for dim, base in ((128, 500000.0), (64, 10000.0)):
        plain = RotaryEmbedding(dim, 1.0, rotary_base=base).inv_freq
        ref = RotaryEmbedding(dim, 1.0, rotary_base=base, rope_scaling=True).inv_freq
        ours = hf_modeling.llama3_scaled(plain.float(), 8.0)
        assert torch.allclose(ours, ref.float(), rtol=1e-6, atol=0), (dim, base)
        assert not torch.allclose(ref, plain)  # the scaling changes some frequencies
    torch.manual_seed(0)
    cfg = dict(vocab_size=64, hidden_size=32, num_layers=1, num_attention_heads=2,
               num_query_groups=1, kv_channels=16, ffn_hidden_size=64,
               rotary_base=500000.0)  # fmt: skip
    a = hf_modeling.MegatronMDForCausalLM(hf_modeling.MegatronMDConfig(**cfg))
    for p in a.parameters():
        torch.nn.init.normal_(p, std=0.5)
    b = hf_modeling.MegatronMDForCausalLM(
        hf_modeling.MegatronMDConfig(**cfg, rope_scaling_factor=8.0)
    )
    b.load_state_dict(a.state_dict())
    ids = torch.randint(0, 64, (1, 64))
    la, lb = a(ids).logits, b(ids).logits
    assert torch.equal(la[:, 0], lb[:, 0]) and not torch.allclose(la[:, 1:], lb[:, 1:])
    args = argparse.Namespace(use_rope_scaling=True, rope_scaling_factor=8.0)
    assert hf_export.unsupported(args) == []


def test_downstream_table_and_trajectory(tmp_path, capsys):
    """tools/downstream.py on evaluate.py reports of three runs (a trajectory folder each, and a
    report without the paper's tasks, left out): the table holds each run's last checkpoint,
    rows named by the part of the run names that differs (a method as the paper spells it),
    the best per column in bold (ties too), the LaTeX table as the paper's, the CSV the same
    values, and the figure is drawn from every checkpoint."""
    import downstream

    names = {"adamw": 45.2, "muon": 47.6, "muonmd": 48.7}  # the paper's averages
    for k, (m, avg) in enumerate(names.items()):
        folder = tmp_path / "evals" / f"moe-0.81B-6.7B-{m}-44.15B"
        folder.mkdir(parents=True)
        for it in (60_000, 84_209):
            late = it == 84_209
            paper = {"mmlu": 25.6 if m != "muonmd" else 23.3, "hellaswag": 50 + k + late,
                     "average": avg - 2 * (not late)}  # fmt: skip
            rep = {"checkpoint": f"/runs/moe-ladder/{folder.name}/iter_{it:07d}",
                   "iteration": it, "tokens": it * 128 * 4096, "paper": paper}  # fmt: skip
            (folder / f"iter_{it:07d}.json").write_text(json.dumps(rep))
    (tmp_path / "valid.json").write_text(json.dumps({"checkpoint": "/r/x/iter_0000001",
                                                     "iteration": 1, "tasks": {}}))  # fmt: skip
    out = tmp_path / "report"
    downstream.main([*map(str, (tmp_path / "evals").iterdir()), str(tmp_path / "valid.json"),
                     f"--out={out}"])  # fmt: skip
    assert "none of the paper's tasks; left out" in capsys.readouterr().err
    md = (out / "table.md").read_text().splitlines()
    assert md[0] == "| run | MMLU | HellaSwag | Avg. |"
    assert md[2:5] == ["| AdamW | **25.6** | 51.0 | 45.2 |", "| Muon | **25.6** | 52.0 | 47.6 |",
                       "| MuonMD | 23.3 | **53.0** | **48.7** |"]  # fmt: skip
    assert "MuonMD: iteration 84209, 44.15B tokens" in md[-1]
    tex = (out / "table.tex").read_text().splitlines()
    assert tex[:4] == ["\\begin{tabular}{lccc}", "\\toprule",
                       "Optimizer & MMLU & HellaSwag & Avg. \\\\", "\\midrule"]  # fmt: skip
    assert tex[6] == "MuonMD & 23.3 & \\textbf{53.0} & \\textbf{48.7} \\\\"
    assert tex[-2:] == ["\\bottomrule", "\\end{tabular}"]
    rows = list(csv.DictReader((out / "table.csv").open()))
    assert [(r["label"], float(r["average"])) for r in rows] == [
        ("AdamW", 45.2), ("Muon", 47.6), ("MuonMD", 48.7)]  # fmt: skip
    assert (out / "trajectory.png").stat().st_size > 20_000
    with pytest.raises(SystemExit, match="no report holds the paper's tasks"):
        downstream.main([str(tmp_path / "valid.json"), f"--out={out}"])


def random_hf_model():
    """The exported model's class at a tiny size, a dense then an MoE layer (4 experts, top-2),
    random weights (std 0.3), in eval mode."""
    from megatron.md.export import hf_modeling

    cfg = dict(vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4,
               num_query_groups=2, kv_channels=8, ffn_hidden_size=64, moe_layers=[0, 1],
               num_experts=4, moe_ffn_hidden_size=16, moe_topk=2)  # fmt: skip
    m = hf_modeling.MegatronMDForCausalLM(hf_modeling.MegatronMDConfig(**cfg)).eval()
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return m


def test_exported_model_reads_the_attention_mask():
    """A padded batch (left or right, the MoE layer included) gives each sequence the logits it
    has alone: padding is kept out of attention and positions count from each sequence's first
    token (lm-eval's generation pads on the left); a mask without padding changes nothing, bit
    for bit; greedy generate() on a left-padded batch continues each prompt as it does alone."""
    torch.manual_seed(0)
    m = random_hf_model()
    a, b = torch.randint(1, 64, (7,)), torch.randint(1, 64, (4,))
    with torch.no_grad():
        alone = [m(x[None]).logits[0] for x in (a, b)]
        both = torch.stack([a, torch.cat([torch.zeros(3, dtype=torch.long), b])])
        mask = torch.ones(2, 7, dtype=torch.long)
        mask[1, :3] = 0
        left = m(both, attention_mask=mask).logits
        right = m(torch.stack([a, torch.cat([b, torch.zeros(3, dtype=torch.long)])]),
                  attention_mask=mask.flip(-1)).logits  # fmt: skip
        full = m(a[None], attention_mask=torch.ones(1, 7, dtype=torch.long)).logits[0]
        assert torch.equal(full, alone[0])
        for got in (left[0], right[0]):
            torch.testing.assert_close(got, alone[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(left[1, 3:], alone[1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(right[1, :4], alone[1], rtol=1e-5, atol=1e-5)
        # without the mask the padded sequence's logits differ: the check can fail
        assert not torch.allclose(m(both).logits[1, 3:], alone[1], atol=1e-3)
        kw = dict(max_new_tokens=3, do_sample=False, pad_token_id=0)
        out = m.generate(both, attention_mask=mask, **kw)
        for row, x in zip(out, (a, b), strict=True):
            assert torch.equal(row[-3:], m.generate(x[None], **kw)[0, -3:])


def test_exported_model_caches_keys_and_values():
    """With a transformers ``DynamicCache`` the exported model reads only the new tokens: the
    logits of a prompt read at once and then token by token, a left-padded batch with its mask
    included, equal those of the whole sequence read at once (dense and MoE layers, to 1e-5);
    greedy generate() (which uses the cache) equals the argmax of full forward passes, beam
    search its own run without the cache."""
    from transformers import DynamicCache

    torch.manual_seed(1)
    m = random_hf_model()
    ids = torch.randint(1, 64, (2, 9))
    ids[1, :3] = 0
    mask = (torch.arange(9) >= 3).long()[None].expand(2, 9).clone()
    mask[0] = 1
    with torch.no_grad():
        whole = m(ids, attention_mask=mask).logits
        cache = DynamicCache()
        steps = [m(ids[:, :5], attention_mask=mask[:, :5], cache=cache).logits]
        for t in range(5, 9):
            steps.append(m(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache).logits)
        assert cache.get_seq_length() == 9
        torch.testing.assert_close(torch.cat(steps, 1)[mask.bool()], whole[mask.bool()],
                                   rtol=1e-5, atol=1e-5)  # fmt: skip
        x, read = ids[:1, 3:], []
        hook = m.decoder.layers[0].register_forward_pre_hook(
            lambda _, a: read.append(a[0].shape[1])
        )
        got = m.generate(x, max_new_tokens=5, do_sample=False)
        hook.remove()
        assert read == [6, 1, 1, 1, 1]  # the prompt, then each new token alone
        # beam search reorders the cache with its beams: as without the cache, padding included
        beam = dict(attention_mask=mask, max_new_tokens=4, num_beams=3, do_sample=False,
                    pad_token_id=0)  # fmt: skip
        assert torch.equal(m.generate(ids, **beam), m.generate(ids, **beam, use_cache=False))
        for _ in range(5):
            x = torch.cat([x, m(x).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(got, x)
