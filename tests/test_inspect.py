"""The first command a user runs: checkpoint -> mesh -> both layouts -> greedy sample."""

import numpy as np
import pytest

from helpers import PRE_LN, make_hf_opt
from jaxrlhf import load_hf, opt_tokenizer, save_hf
from jaxrlhf.inspect import InspectConfig, main, run


def test_inspect_a_checkpoint_with_its_tokenizer(assets, tmp_path, capsys):
    import torch
    from transformers import AutoModelForCausalLM

    config, params = load_hf(make_hf_opt(tmp_path / "hf", **{**PRE_LN, "vocab_size": 50272}))
    folder = save_hf(tmp_path / "model", config, params, tokenizer=opt_tokenizer(assets / "opt-tokenizer"))
    out = run(InspectConfig(model=str(folder), tp=4, dtype="float32", prompt="Hello world", max_new_tokens=5))
    text = capsys.readouterr().out
    assert "mesh {'data': 2, 'model': 4}" in text
    assert "decoder/layers/fc1/kernel" in text and "P(None, None, 'model')" in text
    # The greedy tokens are those of transformers' own greedy decoding of the same weights.
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.tensor([[2, 31414, 232]])  # "</s>Hello world"
    ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False, min_new_tokens=5)
    assert out["tokens"].tolist() == ref[0, 3:].tolist()


@pytest.mark.slow
def test_default_random_model_runs_and_saves(tmp_path, capsys):
    out_dir = tmp_path / "saved"
    main(["model=random:opt-125m", "max_new_tokens=2", "tp=2", f"save_to={out_dir}"])
    text = capsys.readouterr().out
    assert "125.2M parameters" in text and "reshard fsdp -> tp" in text
    config, params = load_hf(out_dir)
    assert config.num_hidden_layers == 12 and params["decoder"]["embed_tokens"]["embedding"].dtype == np.dtype(
        "bfloat16"
    )


def test_bad_preset_is_refused(capsys):
    import pytest

    with pytest.raises(SystemExit) as e:
        main(["model=random:opt-7b"])
    assert e.value.code == 2 and "error: model: unknown preset 'opt-7b'" in capsys.readouterr().err
