import pytest

from edgespec.controller import ControllerConfig
from edgespec.errors import ConfigError


def test_defaults_validate():
    cfg = ControllerConfig().validate()
    assert cfg.window == 32 and cfg.max_depth == 8


@pytest.mark.parametrize(
    "key,value",
    [
        ("window", 0),
        ("window", 1.5),
        ("prior_weight", -1.0),
        ("open_margin", 0.95),
        ("close_margin", float("nan")),
        ("cooldown_tokens", 0),
        ("probe_steps", 0),
        ("max_depth", 17),
        ("max_nodes", 0),
        ("max_width", 9),
        ("ewma_alpha", 1.5),
        ("stop_prob", -0.1),
        ("decay", 0.2),
        ("enable_tree", "yes"),
        ("calibrate_stop", 1),
        ("first_token_plain", "no"),
    ],
)
def test_validation_names_the_key(key, value):
    with pytest.raises(ConfigError) as e:
        ControllerConfig(**{key: value}).validate()
    assert e.value.key == f"controller.{key}"
    assert key in str(e.value)


def test_cross_field_checks():
    with pytest.raises(ConfigError, match="controller.min_depth"):
        ControllerConfig(min_depth=5, max_depth=4).validate()
    with pytest.raises(ConfigError, match="controller.max_cooldown_tokens"):
        ControllerConfig(cooldown_tokens=64, max_cooldown_tokens=32).validate()


def test_from_dict():
    cfg = ControllerConfig.from_dict({"window": 8, "enable_tree": False})
    assert cfg.window == 8 and cfg.enable_tree is False
    assert ControllerConfig.from_dict(None) == ControllerConfig()
    with pytest.raises(ConfigError) as e:
        ControllerConfig.from_dict({"windw": 8})
    assert e.value.key == "controller.windw" and "unknown key" in str(e.value)
    with pytest.raises(ConfigError, match="controller.window"):
        ControllerConfig.from_dict({"window": -3})
    assert ControllerConfig.from_dict(ControllerConfig().as_dict()) == ControllerConfig()
