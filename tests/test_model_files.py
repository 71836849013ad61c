"""Model directories: round trips with transformers, the real MiniLM checkpoint, and clear refusals."""

import json

import pytest
import torch
from hf_reference import our_config, padded_pair_batch, tiny_hf_config, transformers
from safetensors.torch import load_file, save_file

from bertforge import (
    BertConfig,
    BertforgeError,
    BertForPreTraining,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertModel,
)
from bertforge.model_files import unwrap


def close(a, b, atol=1e-5):
    torch.testing.assert_close(a, b, atol=atol, rtol=0)


def tiny_ours(cls=BertForPreTraining, seed=0, **kw):
    torch.manual_seed(seed)
    return cls(our_config(tiny_hf_config(**kw))).eval()


def test_ours_save_loads_in_transformers_without_missing_or_unexpected_keys(tmp_path):
    ours = tiny_ours()
    ours.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    hf, info = transformers.BertForPreTraining.from_pretrained(tmp_path, output_loading_info=True)
    assert info["missing_keys"] == set() or not info["missing_keys"]
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    hf.eval()
    ids, types, mask = padded_pair_batch(ours.config.vocab_size)
    ref = hf(input_ids=ids, token_type_ids=types, attention_mask=mask)
    out = ours(ids, types, mask)
    close(out.mlm_logits[mask.bool()], ref.prediction_logits[mask.bool()])
    close(out.nsp_logits, ref.seq_relationship_logits)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["BertForPreTraining"]


def test_transformers_save_loads_in_ours(tmp_path):
    torch.manual_seed(0)
    hf = transformers.BertForSequenceClassification(tiny_hf_config(num_labels=3)).eval()
    hf.save_pretrained(tmp_path)
    ours = BertForSequenceClassification.from_pretrained(tmp_path).eval()
    assert ours.config.num_labels == 3
    ids, types, mask = padded_pair_batch(hf.config.vocab_size)
    close(ours(ids, types, mask).logits, hf(input_ids=ids, token_type_ids=types, attention_mask=mask).logits)


def test_round_trip_through_our_format_is_exact(tmp_path):
    ours = tiny_ours(BertForTokenClassification, num_labels=4)
    ours.config.id2label = {0: "O", 1: "B-PER", 2: "I-PER", 3: "B-LOC"}
    ours.save_pretrained(tmp_path)
    back = BertForTokenClassification.from_pretrained(tmp_path).eval()
    assert back.config.labels == ["O", "B-PER", "I-PER", "B-LOC"]
    for (n, a), (_, b) in zip(ours.state_dict().items(), back.state_dict().items(), strict=True):
        assert torch.equal(a, b), n


@pytest.mark.slow  # a real 6-layer checkpoint
def test_minilm_real_checkpoint_matches_transformers(minilm_dir):
    from tokenizers import Tokenizer as RustTokenizer

    tok = RustTokenizer.from_file(str(minilm_dir / "tokenizer.json"))
    tok.enable_padding(pad_id=0)
    texts = [("The quick brown fox jumps over the lazy dog.", None),
             ("State of the Union, 1790.", "Fellow-Citizens of the Senate and House of Representatives."),
             ("A gorgeous, witty, seductive movie.", None)]
    enc = tok.encode_batch([a if b is None else (a, b) for a, b in texts])
    ids = torch.tensor([e.ids for e in enc])
    types = torch.tensor([e.type_ids for e in enc])
    mask = torch.tensor([e.attention_mask for e in enc])
    assert mask.min() == 0  # the batch really is padded

    ours = BertModel.from_pretrained(minilm_dir).eval()
    hf = transformers.BertModel.from_pretrained(minilm_dir).eval()
    assert ours.config.num_hidden_layers == 6 and ours.config.hidden_size == 384
    with torch.no_grad():
        out = ours(ids, types, mask)
        ref = hf(input_ids=ids, token_type_ids=types, attention_mask=mask)
    close(out.sequence_output[mask.bool()], ref.last_hidden_state[mask.bool()])
    close(out.pooled_output, ref.pooler_output)


@pytest.mark.slow
def test_encoder_into_task_model_initialises_heads_and_says_so(minilm_dir, capsys):
    model = BertForSequenceClassification.from_pretrained(minilm_dir, num_labels=2)
    assert "initialised 2 weights" in capsys.readouterr().err
    encoder = BertModel.from_pretrained(minilm_dir)
    torch.testing.assert_close(model.bert.encoder.layer[3].attention.qkv.weight,
                               encoder.encoder.layer[3].attention.qkv.weight, rtol=0, atol=0)


def test_pretraining_checkpoint_into_task_model_drops_heads(tmp_path, capsys):
    tiny_ours().save_pretrained(tmp_path)
    model = BertForQuestionAnswering.from_pretrained(tmp_path)
    err = capsys.readouterr().err
    assert "initialised 2 weights" in err and "qa_outputs.*" in err
    assert "ignored" in err and "cls.predictions.*" in err and "bert.pooler.*" in err
    assert model.config.num_labels == 2


def test_legacy_bin_with_gamma_beta_and_wrapper_prefixes(tmp_path):
    ours = tiny_ours()
    state = load_file(_saved(ours, tmp_path / "a") / "model.safetensors")
    legacy = {}
    for k, v in state.items():
        k = k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta")
        legacy["module._orig_mod." + k] = v
    legacy["bert.embeddings.position_ids"] = torch.arange(64)[None]
    legacy["cls.predictions.decoder.weight"] = state["bert.embeddings.word_embeddings.weight"]
    d = tmp_path / "b"
    d.mkdir()
    torch.save(legacy, d / "pytorch_model.bin")
    (d / "config.json").write_text((tmp_path / "a" / "config.json").read_text())
    back = BertForPreTraining.from_pretrained(d)
    for (n, a), (_, b) in zip(ours.state_dict().items(), back.state_dict().items(), strict=True):
        assert torch.equal(a, b), n


@pytest.mark.slow  # a gloo process group and torch.compile
def test_saving_unwraps_compile_and_ddp(tmp_path):
    ours = tiny_ours()
    compiled = torch.compile(ours)
    assert unwrap(compiled) is ours
    _saved(compiled, tmp_path)
    keys = load_file(tmp_path / "model.safetensors").keys()
    assert all(not k.startswith(("module.", "_orig_mod.")) for k in keys)
    assert "bert.encoder.layer.0.attention.self.query.weight" in keys


def _saved(model, path):
    from bertforge.model_files import save_pretrained

    save_pretrained(model, path)
    return path


def test_mismatched_checkpoint_is_one_clear_error(tmp_path):
    tiny_ours().save_pretrained(tmp_path)
    config = BertConfig.from_json(tmp_path).replace(hidden_size=64, num_attention_heads=4)
    with pytest.raises(BertforgeError, match=r"does not fit BertForPreTraining .*shape \(101, 32\) in the checkpoint "
                                             r"but \(101, 64\)"):
        BertForPreTraining.from_pretrained(tmp_path, config=config)
    with pytest.raises(BertforgeError, match="missing bert.encoder.layer.2"):
        BertForPreTraining.from_pretrained(tmp_path, num_hidden_layers=3)


def test_task_head_of_other_size_is_refused(tmp_path):
    tiny_ours(BertForSequenceClassification, num_labels=3).save_pretrained(tmp_path)
    with pytest.raises(BertforgeError, match=r"classifier.weight has shape \(3, 32\).*num_labels"):
        BertForSequenceClassification.from_pretrained(tmp_path, config=BertConfig.from_json(tmp_path).replace(
            num_labels=2, id2label=None))


def test_unexpected_encoder_weights_and_incomplete_qkv_are_refused(tmp_path):
    path = _saved(tiny_ours(), tmp_path)
    state = load_file(path / "model.safetensors")
    state["bert.encoder.layer.0.attention.self.rotary.weight"] = torch.zeros(3)
    save_file(state, path / "model.safetensors")
    with pytest.raises(BertforgeError, match="unexpected bert.encoder.layer.0.attention.self.rotary.weight"):
        BertForPreTraining.from_pretrained(path)
    del state["bert.encoder.layer.0.attention.self.rotary.weight"]
    del state["bert.encoder.layer.1.attention.self.key.bias"]
    save_file(state, path / "model.safetensors")
    with pytest.raises(BertforgeError, match=r"missing attention.self.key.bias"):
        BertForPreTraining.from_pretrained(path)


def test_corrupt_or_absent_weights(tmp_path):
    tiny_ours().save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(BertforgeError, match="cannot read weights .*corrupt"):
        BertForPreTraining.from_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(BertforgeError, match="no model.safetensors or pytorch_model.bin"):
        BertForPreTraining.from_pretrained(tmp_path)
    with pytest.raises(BertforgeError, match="does not exist"):
        BertForPreTraining.from_pretrained(tmp_path / "nope")


def test_pickled_code_is_never_executed(tmp_path):
    class Boom:
        def __reduce__(self):
            return (exec, ("raise SystemExit('code ran')",))

    tiny_ours().save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    torch.save({"x": Boom()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(BertforgeError, match="cannot read weights"):
        BertForPreTraining.from_pretrained(tmp_path)


def test_save_is_atomic_when_interrupted(tmp_path, monkeypatch):
    model = tiny_ours()
    model.save_pretrained(tmp_path)
    before = (tmp_path / "model.safetensors").read_bytes()

    import safetensors.torch

    def failing_save(state, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", failing_save)
    with torch.no_grad():
        model.cls.predictions.bias.add_(1)
    with pytest.raises(OSError, match="disk full"):
        model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def _shard(model, directory, names: tuple[str, str]) -> dict:
    """Save `model` as two safetensors files under `names` and an index naming them."""
    model.save_pretrained(directory)
    state = load_file(directory / "model.safetensors")
    (directory / "model.safetensors").unlink()
    keys = sorted(state)
    halves = {names[0]: keys[: len(keys) // 2], names[1]: keys[len(keys) // 2:]}
    for name, part in halves.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        save_file({k: state[k].contiguous() for k in part}, directory / name)
    index = {"metadata": {}, "weight_map": {k: name for name, part in halves.items() for k in part}}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    return state


def test_a_sharded_index_loads_only_files_inside_the_model_directory(tmp_path):
    model = tiny_ours()
    inside = tmp_path / "inside"
    _shard(model, inside, ("model-1.safetensors", "shards/model-2.safetensors"))
    close(BertForPreTraining.from_pretrained(inside).state_dict(), model.state_dict())
    escapes = ("../model-2.safetensors", str(tmp_path / "model-2.safetensors"), "shards/../../model-2.safetensors")
    for i, escape in enumerate(escapes):  # each names a readable file: only the check stands in the way
        directory = tmp_path / f"hostile{i}"
        _shard(model, directory, ("model-1.safetensors", "shards/model-2.safetensors"))
        (directory / "shards" / "model-2.safetensors").rename(tmp_path / "model-2.safetensors")
        index = json.loads((directory / "model.safetensors.index.json").read_text())
        index["weight_map"] = {k: escape if v.startswith("shards/") else v for k, v in index["weight_map"].items()}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index))
        with pytest.raises(BertforgeError, match="names the weight file .*outside"):
            BertForPreTraining.from_pretrained(directory)
    (inside / "model.safetensors.index.json").write_text('{"weight_map": ["not", "a", "map"]}')
    with pytest.raises(BertforgeError, match="is not a weights index"):
        BertForPreTraining.from_pretrained(inside)


def test_an_untied_decoder_round_trips_and_loads_in_transformers_with_the_same_logits(tmp_path):
    ours = tiny_ours(tie_word_embeddings=False)
    assert ours.config.tie_word_embeddings is False
    decoder = ours.cls.predictions.decoder.weight
    assert decoder.data_ptr() != ours.bert.embeddings.word_embeddings.weight.data_ptr()
    ours.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is False
    back = BertForPreTraining.from_pretrained(tmp_path).eval()
    assert back.config.tie_word_embeddings is False
    assert torch.equal(back.cls.predictions.decoder.weight, decoder)
    hf, info = transformers.BertForPreTraining.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    hf.eval()
    assert hf.cls.predictions.decoder.weight.data_ptr() != hf.bert.embeddings.word_embeddings.weight.data_ptr()
    ids, types, mask = padded_pair_batch(ours.config.vocab_size)
    close(ours(ids, types, mask).mlm_logits[mask.bool()],
          hf(input_ids=ids, token_type_ids=types, attention_mask=mask).prediction_logits[mask.bool()])


def test_a_tied_config_json_stays_as_it_was():
    assert "tie_word_embeddings" not in BertConfig.from_preset("tiny").to_dict()  # transformers' default: tied
    assert BertConfig.from_dict({"tie_word_embeddings": False}).tie_word_embeddings is False
