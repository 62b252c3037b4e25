"""A new engine is one folder plus one registration: the stand-in engine of tests/engines/standin
(nothing else in the project knows it) refits from Megatron trainers bit for bit, and the
command line plans it by name."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

from standin import StandIn  # noqa: E402

from ray_reshard.engines import Engine, register_engine  # noqa: E402
from ray_reshard.execution.reference import simulate_refit  # noqa: E402
from ray_reshard.models import Megatron, hf_parameter_shapes, local_state, refit_specs  # noqa: E402
from ray_reshard.planning import plan  # noqa: E402

register_engine(Engine("standin", StandIn, "infer", "standin:replicas=2"))   # the registration

CONFIG = dict(model_type="qwen3", vocab_size=96, hidden_size=32, intermediate_size=48,
              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
              tie_word_embeddings=False)


def test_a_registered_engine_is_refit_bit_for_bit():
    train, infer = Megatron(tp=2), StandIn(replicas=2)
    g = torch.Generator().manual_seed(0)
    sd = {n: torch.randn(s, generator=g) for n, s in hf_parameter_shapes(CONFIG).items()}
    specs = refit_specs(CONFIG, train=train, infer=infer, dtype=torch.float32)
    p = plan(specs, ["t"] * train.world, ["i0", "i1"])
    src = [local_state(CONFIG, train, "src", r, sd) for r in range(train.world)]
    dst = [{n: torch.zeros(t.shape) for n, t in local_state(CONFIG, infer, "dst", r, sd).items()}
           for r in range(infer.world)]
    simulate_refit(p, src, dst)
    for r in range(infer.world):
        assert dst[r].keys() == sd.keys()
        assert all(torch.equal(dst[r][n], sd[n]) for n in sd)


def test_the_command_line_finds_it_by_name(tmp_path, capsys):
    from ray_reshard.tools.cli import main

    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    assert main(["plan", "--model", str(tmp_path), "--train", "megatron:tp=2",
                 "--infer", "standin:replicas=2", "--dtype", "fp32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["infer"] == "x2"            # StandIn x2, as the plan names it
    assert out["lower_bound_bytes"] > 0
