"""The registry of code kinds (calibrate/codes/): every list of kinds is derived from it, each
kind's roles reach the loader, and each per-frame kind codes one head the same way on its own
(codec.py) and as the head-axis code with one head (quant/headcodec.py), in the bytes it prices."""

import pytest
import torch

from calibrate import codec, recipe_schema
from calibrate.codes import KINDS, NAMES, PER_FRAME
from calibrate.quant import turbo
from calibrate.quant.headcodec import GroupCodec
from calibrate.recipe import KNOWN_ROLES, TensorSpec, expected_shapes

from toys import B, D, H, T, frame, static_tensors

SPECS = {
    "uniform": TensorSpec(bits=2, group_size=8, outliers=1),
    "codebook": TensorSpec(bits=3, kind="codebook", rotation="hadamard"),
    "prq": TensorSpec(bits=2, kind="prq", group_size=8, prq_stages=1, prq_centroids=2),
    "turbo": TensorSpec(bits=2, kind="turbo", rotation="hadamard"),
    "turbo_prod": TensorSpec(bits=3, kind="turbo_prod", rotation="hadamard"),
    "nvfp4": TensorSpec(bits=4, kind="nvfp4", group_size=16),
}


def tensors_for(spec: TensorSpec) -> dict[str, torch.Tensor]:
    out = static_tensors(spec, seed=7)
    if "lloyd_max" in out:  # static_tensors knows the per-frame roles of the first kinds only
        L = out["lloyd_max"].shape[-1]
        out["lloyd_max"] = turbo.beta_lloyd_max(D, L.bit_length() - 1).expand(H, L).clone()
    if "qjl" in out:
        out["qjl"] = torch.stack([turbo.qjl_matrix(D, D, seed=h) for h in range(H)])
    return out


def test_every_list_of_kinds_is_the_registry():
    from recipes import reader  # the foreign reader keeps its own list by design: it must know every kind

    assert recipe_schema.CODE_KINDS == NAMES == tuple(reader.KINDS)
    assert set(PER_FRAME) == set(SPECS) == set(NAMES) - {"predictive"}


@pytest.mark.parametrize("name", NAMES)
def test_a_kinds_roles_are_required_and_known_to_the_loader(name):
    spec = SPECS.get(name, TensorSpec(bits=2, kind="predictive", rotation="learned", token_bits=[32] * H,
                                      anchor_token_bits=[48] * H))
    own = KINDS[name].roles(spec, H, D)
    assert set(own) <= set(KNOWN_ROLES)
    assert bool(own) == (name in ("codebook", "turbo", "turbo_prod", "predictive"))  # uniform, prq: general roles only
    assert expected_shapes(spec, H, D).items() >= own.items()


@pytest.mark.parametrize("name", PER_FRAME)
def test_one_head_codes_alike_alone_and_on_a_head_axis(name):
    spec, tensors = SPECS[name], tensors_for(SPECS[name])
    x = frame(3, (B, T, D))
    p = codec.head_params(spec, tensors, 0)
    group = GroupCodec(spec, tensors, [0], spec.bits, D, torch.device("cpu"))
    state = group_state = None
    if codec.span_of(spec, 0) is not None:
        state = codec.fit_span_state(x, spec, p)
        group_state = group.fit_span_state(x[:, None])
        assert torch.equal(group_state[:, 0], state)
        p = codec.with_span_state(p, state)
    alone = codec.encode(x, spec, p)
    axis = group.encode(x[:, None], span_state=group_state)
    assert alone.keys() == axis.keys()
    for key in alone:
        assert torch.equal(axis[key][:, 0], alone[key]), key
    assert codec.stored_nbytes(alone) == codec.frame_nbytes(spec, spec.bits, B, T, D)
    decoded = group.decode({k: v[:, :, None] for k, v in axis.items()}, T,
                           None if group_state is None else group_state[:, :, None])
    torch.testing.assert_close(decoded[:, 0, 0], codec.decode(alone, spec, p, D), rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", PER_FRAME)
def test_a_uniform_step_is_what_the_kind_says(name):
    spec, tensors = SPECS[name], tensors_for(SPECS[name])
    p = codec.head_params(spec, tensors, 0)
    x = frame(5, (B, T, D))
    if codec.span_of(spec, 0) is not None:
        p = codec.with_span_state(p, codec.fit_span_state(x, spec, p))
    stored = codec.encode(x, spec, p)
    if KINDS[name].uniform_step:
        assert (codec.key_steps(stored, spec, p, T, D) > 0).any()
    else:
        with pytest.raises(ValueError, match="has no uniform step"):
            codec.key_steps(stored, spec, p, T, D)
