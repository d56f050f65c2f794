import pytest

from exllama_integrations import GenerationSettings, InvalidSettingsError
from exllama_integrations.contract.settings import build_settings


def test_defaults_are_valid_and_sampling():
    s = GenerationSettings()
    assert s.max_new_tokens == 256 and not s.greedy and s.stop == []


@pytest.mark.parametrize("kw", [{"temperature": 0}, {"top_k": 1}])
def test_greedy(kw):
    assert GenerationSettings(**kw).greedy


@pytest.mark.parametrize(
    ("field", "value", "rule"),
    [
        ("temperature", -0.1, "greater than or equal"),
        ("top_p", 0.0, "greater than 0"),
        ("top_p", 1.5, "less than or equal"),
        ("top_k", -1, "greater than or equal"),
        ("min_p", 1.0, "less than 1"),
        ("typical", 0.0, "greater than 0"),
        ("repetition_penalty", 0.0, "greater than 0"),
        ("max_new_tokens", 0, "greater than or equal"),
        ("seed", -5, "greater than or equal"),
        ("logprobs", 50, "less than or equal"),
    ],
)
def test_invalid_values_name_the_field_and_rule(field, value, rule):
    with pytest.raises(InvalidSettingsError) as e:
        build_settings({field: value})
    assert field in str(e.value) and rule in str(e.value)


def test_unknown_field_is_rejected():
    with pytest.raises(InvalidSettingsError, match="tempreature"):
        build_settings({"tempreature": 0.5})


@pytest.mark.parametrize("bad", [[1, 2], [""], 3.5, {"a": 1}])
def test_stop_of_wrong_type(bad):
    with pytest.raises(InvalidSettingsError, match="stop"):
        build_settings({"stop": bad})


def test_single_stop_string_is_a_list_and_duplicates_go():
    assert GenerationSettings(stop="###").stop == ["###"]
    assert GenerationSettings(stop=["a", "a", "b"]).stop == ["a", "b"]


def test_merged_unions_stops_and_leaves_original_unchanged():
    base = GenerationSettings(stop=["x"], temperature=0.5)
    m = base.merged(stop=["y"], temperature=None, top_k=5)
    assert m.stop == ["x", "y"] and m.temperature == 0.5 and m.top_k == 5
    assert base.stop == ["x"] and base.top_k == 0


def test_settings_are_immutable():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="frozen"):
        GenerationSettings().temperature = 0.1  # type: ignore[misc]
