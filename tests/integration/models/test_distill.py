"""`meshserve distill` end to end on a tiny random teacher: train, checkpoint, resume, ONNX INT4, load."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from services.common.model_paths import model_paths
from services.models import distill as dist

pytestmark = pytest.mark.integration


def tiny_teacher(path: Path) -> None:
    """A 4-layer Llama with the real tokenizer (head size 64, as the ONNX builder's kernels need)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    hf = model_paths().hf_dir
    tokenizer = AutoTokenizer.from_pretrained(str(hf))
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def test_student_layers_are_initialised_from_the_teacher(tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    tiny_teacher(tmp_path / "teacher")
    teacher = AutoModelForCausalLM.from_pretrained(str(tmp_path / "teacher"))
    fifteen = dist.pick_layers(30, 15)
    assert len(fifteen) == 15 and fifteen[0] == 0 and fifteen[-1] == 29
    assert dist.pick_layers(4, 2) == [0, 3] and dist.pick_layers(30, 30) == list(range(30))
    student = dist.make_student(teacher, [0, 3])
    assert student.config.num_hidden_layers == 2
    t, s = teacher.state_dict(), student.state_dict()
    assert torch.equal(s["model.layers.1.mlp.up_proj.weight"], t["model.layers.3.mlp.up_proj.weight"])
    assert torch.equal(s["model.embed_tokens.weight"], t["model.embed_tokens.weight"])


@pytest.mark.timeout(600)
def test_distill_end_to_end_with_resume_and_int4_export(tmp_path: Path) -> None:
    tiny_teacher(tmp_path / "teacher")
    corpus = tmp_path / "plays.txt"
    corpus.write_text("Now is the winter of our discontent made glorious summer by this sun of York. " * 40)
    base = {
        "teacher": tmp_path / "teacher",
        "out": tmp_path / "student",
        "corpus": [corpus],
        "layers": 2,
        "seq_len": 32,
        "batch_size": 2,
        "warmup_steps": 1,
        "checkpoint_every": 2,
        "ce_weight": 0.5,
        "device": "cpu",
        "show_progress": False,
    }
    first = dist.distill(dist.DistillConfig(**base, steps=2, export=False))  # type: ignore[arg-type]
    assert first.steps_run == 2 and first.resumed_from == 0
    assert (tmp_path / "student" / "checkpoints" / "step-2.pt").is_file()

    second = dist.distill(dist.DistillConfig(**base, steps=4))  # type: ignore[arg-type]
    assert second.resumed_from == 2 and second.steps_run == 2
    assert all(loss == loss and loss >= 0 for loss in first.losses + second.losses)
    checkpoints = sorted(p.name for p in (tmp_path / "student" / "checkpoints").glob("step-*.pt"))
    assert checkpoints == ["step-2.pt", "step-4.pt"]
    log = (tmp_path / "student" / "distill.log").read_text().splitlines()
    assert [line.split("\t")[0] for line in log] == ["step", "1", "2", "3", "4"]  # resumed run appended
    config = json.loads((second.student_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == 2 and (second.student_dir / "tokenizer.json").is_file()

    assert second.edge_dir is not None
    genai = json.loads((second.edge_dir / "genai_config.json").read_text())
    assert genai["model"]["decoder"]["num_hidden_layers"] == 2
    import onnx

    graph = onnx.load(str(second.edge_dir / "model.onnx"), load_external_data=False).graph
    quantized = [n for n in graph.node if n.op_type == "MatMulNBits"]
    assert quantized and all(n.input[5].endswith("bias_correction") for n in quantized)  # the default INT4 options
    import onnxruntime_genai as og

    model = og.Model(str(second.edge_dir))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=12, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens([1, 504, 3458, 282])
    generator.generate_next_token()
    assert 0 <= int(generator.get_next_tokens()[0]) < config["vocab_size"]


def test_cli_reports_a_missing_teacher(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    dist.add_arguments(parser)
    args = parser.parse_args(["--teacher", str(tmp_path / "nope"), "--quiet"])
    assert dist.run(args) == 1
    assert "no teacher checkpoint" in capsys.readouterr().err


@pytest.mark.timeout(600)
def test_distill_on_teacher_generated_text_is_generated_once_and_reused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from services.models import teacher_text

    tiny_teacher(tmp_path / "teacher")
    out = tmp_path / "student"
    tokens: list[int] = []
    real_blocks = dist._blocks

    def counting_blocks(ids: list[int], seq_len: int) -> list[list[int]]:
        tokens.append(len(ids))
        return real_blocks(ids, seq_len)

    monkeypatch.setattr(dist, "_blocks", counting_blocks)
    opts = teacher_text.TeacherTextOptions(samples=3, max_new_tokens=16, batch_size=2)
    base = {"teacher": tmp_path / "teacher", "out": out, "layers": 2, "seq_len": 32, "batch_size": 2}
    first = dist.distill(
        dist.DistillConfig(
            **base,  # type: ignore[arg-type]
            corpus=[],  # teacher text alone: the training below can only have run on it
            steps=2,
            warmup_steps=1,
            device="cpu",
            export=False,
            show_progress=False,
            teacher_text=opts,
        )
    )
    assert first.steps_run == 2 and all(loss == loss for loss in first.losses)
    samples = [json.loads(line) for line in (out / teacher_text.CORPUS_FILE).read_text().splitlines()]
    assert len(samples) == 3 and len({s["prompt"] for s in samples}) == 3
    assert all(s["text"].startswith("<|im_start|>") and 0 < s["new_tokens"] <= 16 for s in samples)
    meta = json.loads((out / teacher_text.META_FILE).read_text())
    assert meta["samples"] == 3 and meta["dropped"] == 0 and meta["settings"]["max_new_tokens"] == 16
    made = (out / teacher_text.CORPUS_FILE).read_bytes()

    def no_generation(*_: object) -> None:
        raise AssertionError("the teacher text was generated again")

    monkeypatch.setattr(teacher_text, "generate", no_generation)
    corpus = tmp_path / "plays.txt"
    corpus.write_text("Now is the winter of our discontent made glorious summer by this sun of York. " * 40)
    parser = argparse.ArgumentParser()
    dist.add_arguments(parser)
    flags = ["--teacher", str(tmp_path / "teacher"), "--out", str(out), "--corpus", str(corpus), "--layers", "2"]
    flags += ["--seq-len", "32", "--batch-size", "2", "--steps", "4", "--checkpoint-every", "2", "--device", "cpu"]
    flags += ["--teacher-text", "3", "--teacher-text-tokens", "16", "--no-export", "--quiet"]
    assert dist.run(parser.parse_args(flags)) == 0  # resumes at step 2 on the same teacher text plus the corpus
    assert (out / teacher_text.CORPUS_FILE).read_bytes() == made
    assert tokens[1] > tokens[0] > 0  # the second run mixed the corpus with the teacher text
    log = (out / "distill.log").read_text().splitlines()
    assert [line.split("\t")[0] for line in log] == ["step", "1", "2", "3", "4"]

    capsys.readouterr()
    other = parser.parse_args([*flags[:-3], "8", "--no-export", "--quiet"])  # 8 new tokens, not 16
    assert dist.run(other) == 1  # other settings: a clear error, no silent regeneration
    assert "max_new_tokens differ" in capsys.readouterr().err
    assert (out / teacher_text.CORPUS_FILE).read_bytes() == made
