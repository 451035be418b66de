"""QNN: QnnQuantizer (PT2E), calibrated on corpus windows, simulated in fake-quant, lowered
to a QNN context binary inside a .pte only when the SDK is there.

Schemes (weights / activations): w8a16 = QuantDtype.use_16a8w, w8a8 = use_8a8w,
w4a16 = use_16a4w; linear weights per output channel, activations per tensor with min/max
observers. "Simulated" means the converted graph (quantize/dequantize around every op) run in
eager on this CPU: the numerics of the chosen quantization, not of the HTP's kernels.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Sequence

import torch

from edge_export.decoder import StaticShape, example_inputs, run_sequence
from edge_export.qnn.sdk import import_qualcomm

SCHEMES = {"w8a16": "use_16a8w", "w8a8": "use_8a8w", "w4a16": "use_16a4w"}
DEFAULT_SOC = "SM8650"  # Snapdragon 8 Gen 3


def quantize(model, shape: StaticShape, scheme: str, calibration: Sequence[torch.Tensor],
             feed: Callable | None = None) -> torch.fx.GraphModule:
    """The converted (fake-quant) graph of `model`, calibrated on `calibration` token windows.

    `feed(step, window)` runs one window through a step (default: run_sequence without a
    prefix). With no calibration windows the observers see only the tracing example (one chunk of
    token 0): what a graph gets when the calibration loop is forgotten. (With no forward at
    all torchao falls back to scale 1, zero point 0, and the output is exactly 0.)
    """
    from torchao.quantization.pt2e import MinMaxObserver
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    qnn_quantizer, quant_dtype = import_qualcomm()
    example = example_inputs(model, shape)
    graph = torch.export.export(model, example).module()
    quantizer = qnn_quantizer()
    quantizer.set_default_quant_config(
        getattr(quant_dtype, SCHEMES[scheme]),
        is_linear_per_channel=True,
        act_observer=MinMaxObserver,
    )
    # QnnQuantizer prints one line per op it has no rule for (integer ops, cat of inputs).
    with contextlib.redirect_stdout(io.StringIO()):
        prepared = prepare_pt2e(graph, quantizer)
    feed = feed or (lambda step, window: run_sequence(model, step, shape, window))
    with torch.no_grad():
        if calibration:
            for window in calibration:
                feed(lambda args: prepared(*args), window)
        else:
            prepared(*example)
    return convert_pt2e(prepared)


def drop_unused_attributes(graph: torch.fx.GraphModule) -> None:
    """convert_pt2e leaves the original fp32 weights on the module next to their int8
    replacements; saved as they are, the .pt2 is bigger than the float model."""
    used = {n.target for n in graph.graph.nodes if n.op == "get_attr"}
    for name, _ in list(graph.named_parameters()) + list(graph.named_buffers()):
        if name not in used:
            owner, _, leaf = name.rpartition(".")
            module = graph.get_submodule(owner) if owner else graph
            delattr(module, leaf)


def fold_weight_dequantize(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy for simulation in which every dequantize of a constant (the int8/int4 weights)
    is computed once and stored as fp32. Same numbers, ~10x faster per call: otherwise each
    call re-dequantizes every weight (embedding and lm_head included)."""
    import copy

    folded = copy.deepcopy(graph)
    for i, node in enumerate(list(folded.graph.nodes)):
        if node.op != "call_function" or "dequantize" not in str(node.target):
            continue
        inputs = [a for a in node.args if isinstance(a, torch.fx.Node)]
        if not inputs or any(a.op != "get_attr" for a in inputs):
            continue
        args = tuple(getattr(folded, a.target) if isinstance(a, torch.fx.Node) else a
                     for a in node.args)
        with torch.no_grad():
            value = node.target(*args, **node.kwargs)
        name = f"_folded_weight_{i}"
        folded.register_buffer(name, value)
        with folded.graph.inserting_before(node):
            const = folded.graph.get_attr(name)
        node.replace_all_uses_with(const)
        folded.graph.erase_node(node)
    folded.graph.eliminate_dead_code()
    drop_unused_attributes(folded)
    folded.recompile()
    return folded


def save_graph(graph: torch.fx.GraphModule, example: tuple, path) -> int:
    """The quantized graph as a torch.export program (.pt2); returns its size in bytes."""
    drop_unused_attributes(graph)
    program = torch.export.export(graph, example)
    torch.export.save(program, str(path))
    return path.stat().st_size


def lower(graph: torch.fx.GraphModule, example: tuple, soc: str = DEFAULT_SOC) -> bytes:
    """A .pte holding the QNN context binary for `soc`. Needs the QNN SDK (libQnnHtp.so)."""
    import_qualcomm()
    from executorch.backends.qualcomm.utils.utils import (
        generate_htp_compiler_spec,
        generate_qnn_executorch_compiler_spec,
        get_soc_to_chipset_map,
        to_edge_transform_and_lower_to_qnn,
    )

    specs = generate_qnn_executorch_compiler_spec(
        soc_model=get_soc_to_chipset_map()[soc],
        backend_options=generate_htp_compiler_spec(use_fp16=False),
    )
    edge = to_edge_transform_and_lower_to_qnn(graph, example, specs)
    return edge.to_executorch().buffer
