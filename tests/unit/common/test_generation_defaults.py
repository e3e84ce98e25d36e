"""A model's generation defaults: checked like requests, layered field by field, applied only to the fields
a request left unset (an explicit field always wins), never a default penalty under a constraint, and read
from a checkpoint's generation_config.json as vLLM reads it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.common.constraints import check_constraint
from services.common.generation_defaults import NO_DEFAULTS, GenerationDefaults, read_generation_config
from services.common.model_paths import model_paths
from services.common.pb.meshserve.v1 import inference_pb2 as pb
from services.common.sampling import DEFAULTABLE, SamplingParams, resolve_sampling
from services.common.sampling_pb import from_pb

CARD = GenerationDefaults(temperature=0.2, top_p=0.9, repetition_penalty=1.1, max_tokens=64, stop=("\n\n",))


def test_unset_fields_get_the_models_defaults_and_set_ones_win() -> None:
    unset = from_pb(pb.SamplingParams())
    assert unset.defaulted == frozenset(DEFAULTABLE)
    applied = CARD.apply(unset)
    assert (applied.temperature, applied.top_p, applied.repetition_penalty, applied.stop) == (0.2, 0.9, 1.1, ("\n\n",))
    assert applied.max_tokens == 0  # fit() takes CARD.max_tokens as its default (the router passes it)
    assert applied.fit(10, 2048, CARD.max_tokens or 256).max_tokens == 64
    assert not applied.defaulted and not applied.greedy
    explicit = from_pb(pb.SamplingParams(temperature=0.0, top_p=1.0, repetition_penalty=1.0, stop=["."], max_tokens=5))
    kept = CARD.apply(explicit)
    assert (kept.temperature, kept.top_p, kept.repetition_penalty, kept.stop, kept.max_tokens) == (0, 1, 1, (".",), 5)
    assert kept.greedy


def test_a_field_the_model_has_no_default_for_keeps_the_neutral_value() -> None:
    applied = GenerationDefaults(top_k=40).apply(resolve_sampling())
    assert (applied.temperature, applied.top_p, applied.top_k, applied.repetition_penalty) == (0.0, 1.0, 40, 1.0)
    assert NO_DEFAULTS.apply(resolve_sampling()) == SamplingParams(max_tokens=0)


def test_parameters_built_directly_are_all_explicit() -> None:
    direct = SamplingParams(max_tokens=8)
    assert CARD.apply(direct) is direct


def test_the_default_penalty_never_applies_under_structured_output_but_an_explicit_one_does() -> None:
    json_mode = resolve_sampling(structured=check_constraint("json_object"))
    applied = CARD.apply(json_mode)
    assert applied.repetition_penalty == 1.0 and applied.temperature == 0.2  # the rest of the defaults apply
    explicit = resolve_sampling(structured=check_constraint("json_object"), repetition_penalty=1.3)
    assert CARD.apply(explicit).repetition_penalty == 1.3


def test_layers_override_field_by_field() -> None:
    checkpoint = GenerationDefaults(temperature=0.7, top_k=50)
    models_file = GenerationDefaults(temperature=0.2, top_p=0.9)
    operator = GenerationDefaults(top_k=0)
    merged = operator.over(models_file.over(checkpoint))
    assert merged == GenerationDefaults(temperature=0.2, top_p=0.9, top_k=0)
    assert merged.as_dict() == {"temperature": 0.2, "top_p": 0.9, "top_k": 0}


@pytest.mark.parametrize(
    ("values", "needle"),
    [
        ({"temperature": 3}, "temperature must be between 0 and 2"),
        ({"top_p": 1.5}, "top_p must be between 0 and 1"),
        ({"repetition_penalty": 0}, "repetition_penalty must be above 0"),
        ({"top_k": -1}, "top_k must be between 0"),
        ({"max_tokens": 0}, "max_tokens must be at least 1"),
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"top_k": 1.5}, "top_k must be an integer"),
        ({"stop": [1]}, "stop must be a string or a list of strings"),
        ({"stop": ["x" * 65]}, "at most 64 characters"),
        ({"min_p": 0.1}, "unknown generation default 'min_p'"),
    ],
)
def test_bad_defaults_are_refused_naming_the_source_and_the_field(values: dict[str, object], needle: str) -> None:
    with pytest.raises(ValueError, match=r"models\.yaml: ") as info:
        GenerationDefaults.from_mapping(values, "models.yaml")
    assert needle in str(info.value)


def test_top_p_zero_means_off_and_a_single_stop_string_is_a_list() -> None:
    d = GenerationDefaults.from_mapping({"top_p": 0, "stop": "END"}, "x")
    assert d.top_p == 1.0 and d.stop == ("END",)


def test_generation_config_json_is_read_as_vllm_reads_it(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(
        json.dumps(
            {
                "do_sample": True,
                "temperature": 0.6,
                "top_p": 0.95,
                "top_k": -1,
                "repetition_penalty": 1.05,
                "max_new_tokens": 512,
                "eos_token_id": [2, 7],
                "bos_token_id": 1,
            }
        )
    )
    d = read_generation_config(tmp_path)
    assert d == GenerationDefaults(temperature=0.6, top_p=0.95, top_k=0, repetition_penalty=1.05, max_tokens=512)


def test_a_checkpoint_without_the_file_or_sampling_keys_has_no_defaults(tmp_path: Path) -> None:
    assert read_generation_config(tmp_path) == NO_DEFAULTS
    assert read_generation_config(None) == NO_DEFAULTS
    (tmp_path / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": 2}')
    assert read_generation_config(tmp_path) == NO_DEFAULTS


def test_the_prepared_smollm2_checkpoint_sets_no_sampling_defaults() -> None:
    hf = model_paths().hf_dir
    if not (hf / "generation_config.json").exists():
        pytest.skip("the model is not prepared here")
    assert read_generation_config(hf) == NO_DEFAULTS  # its card's recommendation lives in deploy/models.yaml


def test_a_broken_generation_config_is_an_error_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text("{")
    with pytest.raises(ValueError, match=r"generation_config\.json is not valid JSON"):
        read_generation_config(tmp_path)
    (tmp_path / "generation_config.json").write_text('{"temperature": 9}')
    with pytest.raises(ValueError, match=r"generation_config\.json: temperature must be between 0 and 2"):
        read_generation_config(tmp_path)
