import json

import pytest

from bertforge import BertConfig
from bertforge.config import PRESETS


@pytest.mark.parametrize("name,layers,hidden,heads", [
    ("tiny", 2, 128, 2), ("mini", 4, 256, 4), ("small", 4, 512, 8), ("medium", 8, 512, 8),
    ("base", 12, 768, 12), ("large", 24, 1024, 16),
])
def test_presets_have_the_published_sizes(name, layers, hidden, heads):
    c = BertConfig.from_preset(name)
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads) == (layers, hidden, heads)
    assert c.intermediate_size == 4 * hidden
    assert c.vocab_size == 30522


def test_preset_overrides_and_unknown_preset():
    assert BertConfig.from_preset("tiny", vocab_size=8000).vocab_size == 8000
    with pytest.raises(ValueError, match="unknown model preset 'huge'"):
        BertConfig.from_preset("huge")
    assert set(PRESETS) == {"tiny", "mini", "small", "medium", "base", "large"}


@pytest.mark.parametrize("field,value,message", [
    ("hidden_size", 100, "not divisible by num_attention_heads"),
    ("vocab_size", 0, "vocab_size=0"),
    ("num_hidden_layers", -1, "num_hidden_layers=-1"),
    ("hidden_act", "swish", "hidden_act='swish'"),
    ("hidden_dropout_prob", 1.5, "hidden_dropout_prob=1.5"),
    ("layer_norm_eps", 0.0, "layer_norm_eps=0.0"),
    ("pad_token_id", 40000, "pad_token_id=40000"),
])
def test_invalid_values_name_the_field_and_value(field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        BertConfig(**{field: value})


def test_json_round_trip_keeps_labels_and_unknown_keys(tmp_path):
    c = BertConfig.from_preset("tiny", num_labels=3, id2label={0: "neg", 1: "neu", 2: "pos"}, task="sst2")
    c.extra["transformers_version"] = "5.0"
    c.to_json(tmp_path / "config.json")
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw["model_type"] == "bert"
    assert raw["id2label"] == {"0": "neg", "1": "neu", "2": "pos"}
    assert raw["label2id"] == {"neg": 0, "neu": 1, "pos": 2}
    back = BertConfig.from_json(tmp_path)
    assert back == c
    assert back.labels == ["neg", "neu", "pos"]


def test_reads_hugging_face_config(tmp_path):
    transformers = pytest.importorskip("transformers")
    hf = transformers.BertConfig(vocab_size=1234, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                 intermediate_size=100, hidden_act="gelu_new")
    hf.save_pretrained(tmp_path)
    c = BertConfig.from_json(tmp_path / "config.json")
    assert (c.vocab_size, c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.intermediate_size) == (
        1234, 64, 3, 4, 100)
    assert c.hidden_act == "gelu_new"


def test_refuses_other_models_and_bad_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="not a BERT model"):
        BertConfig.from_json(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"position_embedding_type": "relative_key"}))
    with pytest.raises(ValueError, match="position_embedding_type"):
        BertConfig.from_json(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        BertConfig.from_json(tmp_path)
    with pytest.raises(ValueError, match="no config.json"):
        BertConfig.from_json(tmp_path / "nowhere")


def test_config_files_that_are_not_a_json_object_name_the_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b'{"hidden_size": 64, "name": "caf\xe9"}')
    with pytest.raises(ValueError, match=f"{path}:1: not UTF-8 text \\(byte 0xe9 at offset 32\\)"):
        BertConfig.from_json(tmp_path)
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a JSON object"):
        BertConfig.from_json(path)
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps({"hidden_size": 64, "num_attention_heads": 4}).encode())
    assert BertConfig.from_json(path).hidden_size == 64  # a byte-order mark, as some editors write
    path.unlink()
    path.mkdir()  # a model directory whose config.json is a directory
    with pytest.raises(ValueError, match=f"cannot read {path} "):
        BertConfig.from_json(tmp_path)


@pytest.mark.parametrize("id2label", [["neg", "pos"], {"first": "neg"}, 5, "ab"])
def test_a_label_map_that_is_not_one_names_it(id2label):
    with pytest.raises(ValueError, match="id2label"):
        BertConfig.from_dict({"id2label": id2label})
