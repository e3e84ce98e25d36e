from __future__ import annotations

import pytest

from services.common.config import load_settings
from services.common.errors import ConfigError
from services.router.config import RouterSettings


def test_comma_lists_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHSERVE_ROUTER_EDGE_WORKERS", "127.0.0.1:7101, localhost:7102,")
    monkeypatch.setenv("MESHSERVE_ROUTER_CLOUD_WORKERS", "10.0.0.1:7201")
    monkeypatch.setenv("MESHSERVE_ROUTER_EDGE_MAX_PROMPT_TOKENS", "64")
    s = load_settings(RouterSettings)
    assert s.edge_workers == ["127.0.0.1:7101", "localhost:7102"]
    assert s.cloud_workers == ["10.0.0.1:7201"]
    assert s.edge_max_prompt_tokens == 64
    assert s.default_max_tokens == 256
    assert s.redis_url == ""


def test_needs_static_workers_only_without_self_registration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MESHSERVE_ROUTER_EDGE_WORKERS", raising=False)
    monkeypatch.delenv("MESHSERVE_ROUTER_CLOUD_WORKERS", raising=False)
    assert load_settings(RouterSettings).accept_registrations  # workers will register themselves
    with pytest.raises(ConfigError, match="MESHSERVE_ROUTER_EDGE_WORKERS"):
        load_settings(RouterSettings, accept_registrations=False)


def test_bad_address() -> None:
    with pytest.raises(ConfigError, match="host:port"):
        load_settings(RouterSettings, edge_workers="nohost")


def test_tenant_maps_parse_and_explain_mistakes() -> None:
    from services.common.config import load_settings
    from services.common.errors import ConfigError
    from services.router.config import RouterSettings

    s = load_settings(
        RouterSettings,
        edge_workers="127.0.0.1:1",
        tenant_ttft_slo_ms="acme:2000, free:8000",
        tenant_weights="gold:3",
        tenant_tiers="free:edge,acme:edge,acme:cloud",
    )
    assert s.tenant_ttft_slo_ms == {"acme": 2000.0, "free": 8000.0}
    assert s.tenant_weights == {"gold": 3.0}
    assert s.tenant_tiers == {"free": ["edge"], "acme": ["edge", "cloud"]}
    for field, bad in (("tenant_ttft_slo_ms", "acme=2000"), ("tenant_tiers", "free:gpu")):
        try:
            load_settings(RouterSettings, edge_workers="127.0.0.1:1", **{field: bad})
        except ConfigError as exc:
            assert "tenant:" in str(exc)
        else:
            raise AssertionError(f"{field}={bad!r} must be refused")


@pytest.mark.parametrize(
    "url", ["redis://127.0.0.1:6379/0", "redis+sentinel://s1:26379/mymaster", "redis+cluster://10.0.0.1:7000", ""]
)
def test_redis_urls_of_every_kind_are_accepted(url: str) -> None:
    assert load_settings(RouterSettings, edge_workers="127.0.0.1:1", redis_url=url).redis_url == url


@pytest.mark.parametrize(
    ("url", "fix"),
    [("redis+sentinel://s1:26379", "must name the master"), ("localhost:6379", "unsupported Redis URL scheme")],
)
def test_a_malformed_redis_url_is_a_config_error(url: str, fix: str) -> None:
    with pytest.raises(ConfigError, match="MESHSERVE_ROUTER_REDIS_URL") as err:
        load_settings(RouterSettings, edge_workers="127.0.0.1:1", redis_url=url)
    assert fix in str(err.value)


def test_without_a_models_file_one_model_is_served_by_every_worker() -> None:
    from services.router.config import RouterSettings

    specs, default, by_model = load_settings(RouterSettings, edge_workers="127.0.0.1:1").served_models()
    assert (default, by_model, [s.id for s in specs]) == (RouterSettings().model_id, False, [default])
    assert len(specs[0].versions) == 1


def test_a_models_file_declares_models_versions_and_rollouts(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from services.router.config import RouterSettings

    path = tmp_path / "models.yaml"
    path.write_text(
        "default: b\nmodels:\n"
        "  - {id: a, versions: [{name: v1, build: x}, {name: v2}, {name: v3, build: prepared}],"
        " rollout: {weights: {v1: 95, v2: 5}, shadow: v2}}\n"
        "  - {id: b, context_length: 512}\n"
    )
    specs, default, by_model = load_settings(
        RouterSettings, models_file=str(path), models_dir=str(tmp_path)
    ).served_models()
    assert (default, by_model) == ("b", True)
    assert [v.build_id for v in specs[0].versions] == ["x", "v2", "unprepared"]  # no manifest in models_dir
    assert specs[1].context_length == 512 and len(specs[1].versions) == 1  # the prepared build
    bad = {
        "models: []\n": "models",
        "models:\n  - {id: a, colour: red}\n": "colour",
        "models:\n  - {id: a}\n  - {id: a}\n": "twice",
        "default: z\nmodels:\n  - {id: a}\n": "default 'z'",
        "models:\n  - {id: a, versions: [{name: v1}], rollout: {weights: {v9: 1}}}\n": "no version 'v9'",
        "models: [\n": "cannot read",
    }
    for text, message in bad.items():
        path.write_text(text)
        with pytest.raises(ConfigError, match=message):
            load_settings(RouterSettings, models_file=str(path))


def test_generation_defaults_layer_checkpoint_model_version_and_operator(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    checkpoint = tmp_path / "hf"
    checkpoint.mkdir()
    (checkpoint / "generation_config.json").write_text('{"temperature": 0.7, "top_k": 50, "max_new_tokens": 300}')
    path = tmp_path / "models.yaml"
    path.write_text(
        f"models:\n  - id: a\n    tokenizer_dir: {checkpoint}\n"
        "    generation: {temperature: 0.2, top_p: 0.9}\n"
        "    versions: [{name: v1}, {name: v2, generation: {repetition_penalty: 1.1}}]\n"
    )
    settings = load_settings(RouterSettings, models_file=str(path))
    specs, _, _ = settings.served_models()
    v1, v2 = specs[0].versions
    assert settings.generation_defaults_for(specs[0], v1).as_dict() == {
        "temperature": 0.2,
        "top_p": 0.9,
        "top_k": 50,
        "max_tokens": 300,
    }
    assert settings.generation_defaults_for(specs[0], v2).repetition_penalty == 1.1
    monkeypatch.setenv("MESHSERVE_ROUTER_GENERATION_DEFAULTS", '{"temperature": 0, "stop": ["END"]}')
    operator = load_settings(RouterSettings, models_file=str(path))
    merged = operator.generation_defaults_for(specs[0], v1)
    assert (merged.temperature, merged.top_p, merged.stop) == (0.0, 0.9, ("END",))


def test_the_shipped_models_file_gives_the_default_model_its_model_cards_sampling() -> None:
    from services.local.mesh import DEFAULT_MODELS_FILE

    settings = load_settings(RouterSettings, models_file=str(DEFAULT_MODELS_FILE))
    specs, default, _ = settings.served_models()
    assert default == RouterSettings().model_id
    assert settings.generation_defaults_for(specs[0], specs[0].versions[0]).as_dict() == {
        "temperature": 0.2,
        "top_p": 0.9,
        "repetition_penalty": 1.1,
    }


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("models:\n  - {id: a, generation: {temperature: 5}}\n", "temperature must be between 0 and 2"),
        ("models:\n  - {id: a, generation: {top_q: 1}}\n", "top_q"),
        ("models:\n  - {id: a, versions: [{name: v, generation: {top_p: 2}}]}\n", "top_p must be between 0 and 1"),
    ],
)
def test_bad_generation_defaults_are_config_errors_naming_the_field(tmp_path, text: str, message: str) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "models.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_settings(RouterSettings, models_file=str(path))


def test_the_idle_policy_comes_from_the_version_else_the_model_else_the_settings(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from services.router.config import IdleSpec

    path = tmp_path / "models.yaml"
    path.write_text(
        "models:\n"
        "  - id: a\n"
        "    idle: {min_replicas: 0, idle_after_s: 30, stop_after_s: 600}\n"
        "    versions: [{name: v1}, {name: v2, idle: {min_replicas: 2}}]\n"
        "  - {id: b}\n"
    )
    settings = load_settings(RouterSettings, models_file=str(path), idle_after_s=5)
    specs, _, _ = settings.served_models()
    a, b = specs
    assert settings.idle_for(a, a.versions[0]) == IdleSpec(min_replicas=0, idle_after_s=30, stop_after_s=600)
    assert settings.idle_for(a, a.versions[1]) == IdleSpec(min_replicas=2)  # the whole block, not field by field
    assert settings.idle_for(b, b.versions[0]) == IdleSpec(min_replicas=1, idle_after_s=5)


def test_the_idle_policy_defaults_keep_one_replica_awake_and_never_sleep() -> None:
    from services.router.config import IdleSpec

    settings = RouterSettings()
    specs, _, _ = settings.served_models()
    assert settings.idle_for(specs[0], specs[0].versions[0]) == IdleSpec(min_replicas=1)
    assert (settings.wake_deadline_s, settings.max_held_per_model) == (60.0, 1024)


def test_idle_settings_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHSERVE_ROUTER_IDLE_MIN_REPLICAS", "0")
    monkeypatch.setenv("MESHSERVE_ROUTER_IDLE_AFTER_S", "2.5")
    monkeypatch.setenv("MESHSERVE_ROUTER_IDLE_STOP_AFTER_S", "60")
    monkeypatch.setenv("MESHSERVE_ROUTER_WAKE_DEADLINE_S", "10")
    monkeypatch.setenv("MESHSERVE_ROUTER_MAX_HELD_PER_MODEL", "16")
    settings = load_settings(RouterSettings)
    assert (settings.idle_min_replicas, settings.idle_after_s, settings.idle_stop_after_s) == (0, 2.5, 60)
    assert (settings.wake_deadline_s, settings.max_held_per_model) == (10, 16)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("models:\n  - {id: a, idle: {min_replicas: -1}}\n", "min_replicas"),
        ("models:\n  - {id: a, idle: {idle_after_s: 0}}\n", "idle_after_s"),
        ("models:\n  - {id: a, idle: {idle_after_s: 5, stop_after_s: 60}}\n", "set min_replicas to 0"),
        ("models:\n  - {id: a, idle: {idle_after: 5}}\n", "idle_after"),
        ("models:\n  - {id: a, versions: [{name: v, idle: {stop_after_s: -1, min_replicas: 0}}]}\n", "stop_after_s"),
    ],
)
def test_bad_idle_policies_are_config_errors_naming_the_field(tmp_path, text: str, message: str) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "models.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_settings(RouterSettings, models_file=str(path))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"idle_stop_after_s": 60}, "IDLE_MIN_REPLICAS is 1"),
        ({"wake_deadline_s": 0}, "WAKE_DEADLINE_S"),
        ({"max_held_per_model": 0}, "MAX_HELD_PER_MODEL"),
        ({"idle_after_s": -1}, "IDLE_AFTER_S"),
    ],
)
def test_bad_idle_settings_are_config_errors(fields: dict[str, float], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings(RouterSettings, **fields)


def test_the_routing_policy_is_a_name_from_the_policy_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MESHSERVE_ROUTER_EDGE_WORKERS", "127.0.0.1:1")
    monkeypatch.setenv("MESHSERVE_ROUTER_ROUTING_POLICY", "round_robin")
    assert load_settings(RouterSettings).routing_policy == "round_robin"
    monkeypatch.setenv("MESHSERVE_ROUTER_ROUTING_POLICY", "fastest")
    with pytest.raises(ConfigError, match="unknown routing policy 'fastest'; choose one of cache_aware, round_robin"):
        load_settings(RouterSettings)
