"""ONNX Runtime behind `predict` and `embed`: the PyTorch engines' results from a model directory (exported on
the way) or from its export, int8 close to them, impossible combinations one error line. Each test exports
models: slow."""

import json

import numpy as np
import pytest
from infer_support import TEXTS, cosines

from bertforge import BertforgeError
from bertforge.cli import main
from bertforge.infer import Encoder, EngineOptions, Predictor

pytestmark = pytest.mark.slow


def test_onnx_backend_predicts_what_the_torch_engine_does(clf_dir, mlm_dir, tmp_path, capsys):
    """ONNX Runtime behind `predict`: on the fine-tuned directory (exported on the way) and on its export, the
    PyTorch engine's probabilities to 1e-5; its int8 close to them; impossible combinations one error line."""
    pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install bertforge[onnx])")
    from bertforge.export import export_onnx

    records = [{"text": t} for t in TEXTS if t]
    expected = np.array([[r["probabilities"][k] for k in ("negative", "positive")]
                         for r in Predictor(clf_dir).predict(records)])
    export_onnx(clf_dir, tmp_path / "exported")
    for path, quantize, tolerance in ((clf_dir, None, 1e-5), (tmp_path / "exported", None, 1e-5),
                                      (clf_dir, "int8", 0.05)):
        predictor = Predictor(path, EngineOptions(backend="onnx", quantize=quantize))
        assert type(predictor.task_model.model).__name__ == "OrtModel"
        got = np.array([[r["probabilities"][k] for k in ("negative", "positive")]
                        for r in predictor.predict(records, batch_size=2)])
        np.testing.assert_allclose(got, expected, atol=tolerance)
    capsys.readouterr()
    assert main(["predict", "--model", str(tmp_path / "exported"), "--backend", "onnx", "--text", *TEXTS[:2]]) == 0
    cli = [json.loads(line)["probabilities"]["positive"] for line in capsys.readouterr().out.splitlines()]
    np.testing.assert_allclose(cli, expected[:2, 1], atol=1e-5)
    for flags, message in ((["--precision", "bf16"], "--backend onnx runs fp32 or int8"),
                           (["--device", "cuda"], "--backend onnx runs ONNX Runtime on the CPU")):
        assert main(["predict", "--model", str(clf_dir), "--backend", "onnx", "--text", "x", *flags]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {message}") and err.count("\n") == 1
    export_onnx(mlm_dir, tmp_path / "encoder")  # an encoder: nothing to predict
    assert main(["predict", "--model", str(tmp_path / "encoder"), "--backend", "onnx", "--text", "x"]) == 2
    assert "has no task.json" in capsys.readouterr().err


def test_onnx_backend_embeds_what_the_torch_engine_does(mlm_dir, clf_dir, tmp_path, capsys):
    """`embed --backend onnx`: the encoder of a pretrained or fine-tuned directory (exported on the way) or of an
    encoder export gives the PyTorch engine's vectors for every pooling it has; int8 points the same way; a task
    model's export is refused in one line."""
    pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install bertforge[onnx])")
    from bertforge.export import export_onnx

    export_onnx(mlm_dir, tmp_path / "encoder")
    # (the PyTorch directory, what the ONNX Runtime engine is given, the poolings the model has)
    for source, given, poolings in ((mlm_dir, mlm_dir, ("cls", "mean")),
                                    (mlm_dir, tmp_path / "encoder", ("cls", "mean")),
                                    (clf_dir, clf_dir, ("cls", "mean", "pooler"))):
        reference, engine = Encoder(source), Encoder(given, EngineOptions(backend="onnx"))
        for pooling in poolings:
            np.testing.assert_allclose(engine.embed(TEXTS, pooling=pooling), reference.embed(TEXTS, pooling=pooling),
                                       atol=1e-5)
    with pytest.raises(BertforgeError, match="no pooler weights"):
        Encoder(mlm_dir, EngineOptions(backend="onnx")).embed(TEXTS, pooling="pooler")
    fp32 = Encoder(mlm_dir).embed(TEXTS, pooling="mean")
    int8 = Encoder(mlm_dir, EngineOptions(backend="onnx", quantize="int8")).embed(TEXTS, pooling="mean")
    assert cosines(fp32, int8).min() > 0.999 and np.abs(fp32 - int8).max() > 0  # close, and really quantized
    export_onnx(clf_dir, tmp_path / "classifier")
    capsys.readouterr()
    assert main(["embed", "--model", str(tmp_path / "classifier"), "--backend", "onnx", "--text", "x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "not an encoder's" in err and err.count("\n") == 1


