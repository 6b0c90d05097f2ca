"""Configs: YAML + dotted overrides into frozen dataclasses, with errors that name the key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from bertforge.config import from_dict, load_config, load_config_and_data, parse_overrides, parse_value
from bertforge.data.suites import load_suite
from bertforge.errors import UserError
from bertforge.model.config import PRESETS, ModelConfig
from bertforge.tasks.finetune import FinetuneConfig
from bertforge.tasks.init import InitConfig
from bertforge.tasks.pretrain import PretrainConfig

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# configs/<stage>/*.yaml -> the stage's config class
SCHEMAS = {"init": InitConfig, "pretrain": PretrainConfig, "finetune": FinetuneConfig}


def shipped_configs():
    return sorted(CONFIGS.glob("*/*.yaml"))


def test_every_shipped_yaml_parses():
    files = shipped_configs()
    assert files, "no configs shipped"
    for path in files:
        if path.parent.name == "suites":  # benchmark suites, read by `bertforge suite`
            assert load_suite(str(path)).tasks
            continue
        cfg = load_config(SCHEMAS[path.parent.name], path)
        assert dataclasses.is_dataclass(cfg)


def test_presets_have_the_published_sizes():
    sizes = {name: (c.num_layers, c.hidden_size) for name, c in PRESETS.items()}
    assert sizes == {
        "test": (2, 32),
        "tiny": (2, 128),
        "mini": (4, 256),
        "small": (4, 512),
        "medium": (8, 512),
        "base": (12, 768),
        "large": (24, 1024),
    }
    assert PRESETS["base"].num_params() == pytest.approx(110e6, rel=0.02)  # BERT-base's 110M
    assert PRESETS["large"].num_params() == pytest.approx(335e6, rel=0.02)  # BERT-large's 335M


def test_yaml_preset_and_dotted_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model:\n  preset: mini\n  hidden_dropout: 0.0\nhead: sequence\n")
    cfg = load_config(InitConfig, path, ["--model.num_layers=2", "--num_labels", "3", "--model.dtype=bfloat16"])
    assert cfg.model == dataclasses.replace(PRESETS["mini"], num_layers=2, hidden_dropout=0.0, dtype="bfloat16")
    assert (cfg.head, cfg.num_labels) == ("sequence", 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.num_layers = 5  # type: ignore[misc]


def test_exponents_without_a_dot_are_numbers():
    from bertforge.train.optim import OptimConfig

    assert from_dict(OptimConfig, parse_overrides(["--lr=3e-4"])).lr == 3e-4
    with pytest.raises(UserError, match=r"config key 'lr': expected a number, got 'fast'"):
        from_dict(OptimConfig, {"lr": "fast"})


def test_roberta_family_takes_roberta_conventions():
    cfg = from_dict(InitConfig, {"model": {"preset": "mini", "family": "roberta"}})
    assert (cfg.model.pad_token_id, cfg.model.type_vocab_size, cfg.model.max_position_embeddings) == (1, 1, 514)
    assert cfg.model.max_seq_len == 512


def test_a_model_section_written_before_family_was_named_flavor_still_reads():
    old = from_dict(InitConfig, {"model": {"preset": "mini", "flavor": "roberta"}})
    assert old.model == from_dict(InitConfig, {"model": {"preset": "mini", "family": "roberta"}}).model
    assert old.model.family == "roberta"


def test_unknown_key_is_named_with_a_suggestion():
    with pytest.raises(UserError, match=r"unknown config key 'model.num_layer' \(did you mean 'model.num_layers'\?\)"):
        from_dict(InitConfig, {"model": {"num_layer": 3}})
    with pytest.raises(UserError, match=r"unknown config key 'bogus'"):
        from_dict(InitConfig, parse_overrides(["--bogus=1"]))


def test_wrong_type_is_named():
    with pytest.raises(UserError, match=r"config key 'model.num_layers': expected an integer, got 'four'"):
        from_dict(InitConfig, {"model": {"num_layers": "four"}})
    with pytest.raises(UserError, match=r"config key 'model.hidden_dropout': expected a number, got True"):
        from_dict(InitConfig, {"model": {"hidden_dropout": True}})
    with pytest.raises(UserError, match=r"config key 'head': 'lm' is not one of 'mlm', 'sequence'"):
        from_dict(InitConfig, {"head": "lm"})


def test_a_number_given_for_text_is_its_text():
    # `--folds.run=0` (one fold, as the flag's help writes it) and a column whose name YAML reads as a number.
    cfg = load_config(FinetuneConfig, overrides=["--folds.run=0", "--data.text_column=2020"])
    assert cfg.folds.run == "0" and cfg.data.text_column == "2020"
    with pytest.raises(UserError, match=r"config key 'data.text_column': expected a string, got True"):
        load_config(FinetuneConfig, overrides=["--data.text_column=true"])


def test_a_bad_value_is_blamed_on_where_it_came_from(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  batch_size: many\n")
    with pytest.raises(UserError, match=r"^.*run.yaml: config key 'train.batch_size': expected an integer"):
        load_config(FinetuneConfig, path)
    path.write_text("train:\n  batch_size: 8\n")
    with pytest.raises(UserError, match=r"^config key 'train.epochs': expected a number, got 'two'$"):
        load_config(FinetuneConfig, path, ["--train.epochs=two"])


def test_invalid_values_are_named():
    with pytest.raises(UserError, match=r"hidden_size 100 is not divisible by num_heads 3"):
        from_dict(ModelConfig, {"hidden_size": 100, "num_heads": 3})


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(
        UserError, match=r"unknown preset 'huge' for config key 'model.preset' \(choose from test, tiny"
    ):
        from_dict(InitConfig, {"model": {"preset": "huge"}})


def test_yaml_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(UserError, match=r"bad.yaml: line \d+ is not valid YAML"):
        load_config(InitConfig, bad)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("model:\n  preset: mini\n  layers: 3\n")
    with pytest.raises(UserError, match=r"wrong.yaml: unknown config key 'model.layers'"):
        load_config(InitConfig, wrong)
    with pytest.raises(UserError, match=r"missing.yaml: no such config file"):
        load_config(InitConfig, tmp_path / "missing.yaml")


def test_a_section_given_in_part_keeps_the_stage_defaults(tmp_path):
    # Fine-tuning's optimizer and log defaults differ from the classes' own (AdamW beta2 and eps as the Trainer's);
    # setting only the learning rate must not bring the pretraining values back.
    path = tmp_path / "ft.yaml"
    path.write_text("optim:\n  lr: 1.0e-4\nlog:\n  every: 5\n")
    cfg = load_config(FinetuneConfig, path)
    default = FinetuneConfig()
    assert cfg.optim == dataclasses.replace(default.optim, lr=1e-4)
    assert cfg.log == dataclasses.replace(default.log, every=5)
    assert cfg.optim.b2 != PretrainConfig().optim.b2  # the two stages really differ here
    # Pretraining's model defaults to the mini preset: a layer count alone keeps mini's width; a preset replaces it.
    two = load_config(PretrainConfig, None, ["--model.num_layers=2"]).model
    assert two == dataclasses.replace(PRESETS["mini"], num_layers=2)
    assert load_config(PretrainConfig, None, ["--model.preset=small"]).model == PRESETS["small"]


def test_a_key_given_as_a_value_and_as_a_section_is_refused():
    # Fine-tuning's `model` is the folder to start from: `--model.attention=xla` beside it used to vanish under it,
    # so the run went on without the setting. Either order, from a file or a flag, is one clear line.
    with pytest.raises(
        UserError, match=r"'model' is given both as a value and as a section with keys \(model.attention\)"
    ):
        load_config_and_data(FinetuneConfig, None, ["--model.attention=xla"], {"model": "minilm"})
    with pytest.raises(UserError, match=r"'train.dtype' is given both .*train.dtype.x"):
        load_config_and_data(FinetuneConfig, None, ["--train.dtype=float32"], {"train": {"dtype": {"x": 1}}})
    cfg, _ = load_config_and_data(FinetuneConfig, None, ["--train.attention=xla"], {"model": "minilm"})
    assert (cfg.model, cfg.train.attention) == ("minilm", "xla")


def test_override_values_are_yaml_scalars_and_text_otherwise():
    raw = ("null", "true", "3", "0.5", "[a, b]", "", "head+tail", "a: [")
    assert [parse_value(v) for v in raw] == [None, True, 3, 0.5, ["a", "b"], "", "head+tail", "a: ["]
    assert parse_overrides(["--optim.clip_norm=null", "--data.target_columns", "[a, b]"]) == {
        "optim": {"clip_norm": None},
        "data": {"target_columns": ["a", "b"]},
    }
