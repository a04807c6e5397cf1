"""The front end: any nn.Module to a GraphModule that is checked against the eager model.

    capture.py    capture(): the front ends in order, the check against eager, CaptureInfo
    tracers.py    torch.fx symbolic tracing and torch.export, on a flat root of the model
    batching.py   which dimension of every input and output is the batch
    shapes.py     TensorInfo on every node, symbolic in the micro-batch size
    meta.py       models on the meta device: the check on a twin or by shapes, ops that need data
    branches.py   capture="follow_branches": an `if` on a tensor's value takes the example's way
    lazy_code.py  the captured graph's Python generated when first used, not after capture
"""
