"""``nn.RNN`` / ``nn.LSTM`` / ``nn.GRU`` on a sequence split along time and/or batch.

Why the modules are routed rather than their ops: aten's recurrent layers (``aten::lstm.input``, ``gru.input``,
``rnn_tanh.input``, ``rnn_relu.input``) are composite: their cell adds the input's gates into the hidden state's
gates in place, and the first step's hidden state is a plain tensor of zeros, so op by op every gate is gathered into
it and the whole recurrence runs on every rank. The modules' ``forward`` is patched (``_patches.py``) to come here
when the input is a ShardTensor; every other call runs torch's own ``forward``.

How it runs, layer by layer on this rank's rows with torch's own single-layer kernel (``torch._VF.lstm`` / ``gru``
/ ``rnn_tanh`` / ``rnn_relu``, any backend):

- **Batch split only**: each rank runs its own sequences whole; nothing crosses ranks in the forward.
- **Time split** (one mesh dim): a recurrence cannot start before the state entering its rows exists, so the ranks
  along the time split run one after another -- the first from the initial state, each passing its end state to
  the next (a ring pass of one (B, H) state per step); the reverse direction of a bidirectional layer relays the
  other way. A unidirectional stack runs as a wavefront: while a rank runs layer l on its rows, the next runs layer
  l - 1 on its own, so L layers over P ranks take L + P - 1 local layer times rather than L * P (a bidirectional
  layer needs both directions' whole rows before the next, so its layers run one after another). The work stays
  divided (each rank computes and holds only its rows' activations).
- Backward is the same relay reversed: the last rank's rows first, each passing the gradient of its entering state
  to the rank before; all of it inside one autograd node per direction of a stack (per layer and direction when
  bidirectional), so every rank communicates in the same order. The weights' gradients (each rank's term) are
  summed over every mesh dim that splits the input, the initial states' over the time split (one all-reduce each
  per node).
- Outputs: the sequence output keeps the input's layout; ``h_n`` (and ``c_n``) hold the whole final states, split
  along batch like the input, completed along time (one all-reduce).

Falls back to torch's own ``forward`` (op by op: right values, not divided) for packed sequences, dropout between
layers in training, a split feature dim, and a plain initial state that requires grad.
"""
from __future__ import annotations

import functools

import torch

from .ring import completed, sum_over_mesh_dims

_KERNELS = {"LSTM": "lstm", "GRU": "gru", "RNN_TANH": "rnn_tanh", "RNN_RELU": "rnn_relu"}


def routed_forward(original):
    """``forward`` of ``nn.RNN``/``nn.LSTM``/``nn.GRU``: ShardTensor inputs go to ``sharded_forward``. Inside
    compiled code (a traced ShardTensor input) the relay runs eagerly on C++ ShardTensors (functions.call_eagerly: a
    graph break while Dynamo traces); compiled op by op, the recurrence would gather every gate."""
    from . import functions
    from ._traced import TracedShard

    def sharded_or_original(self, input, hx=None):
        from . import _C
        if isinstance(input, torch.Tensor) and _C.is_shard_tensor(input):
            out = sharded_forward(self, input, hx)
            if out is not None:
                return out
        return original(self, input, hx)

    @functools.wraps(original)
    def forward(self, input, hx=None):
        if isinstance(input, TracedShard):
            return functions.call_eagerly(sharded_or_original, (self, input, hx), {})
        if torch.compiler.is_compiling():
            return original(self, input, hx)
        return sharded_or_original(self, input, hx)
    return forward


class _Plan:
    """What one relay node (one direction of one or more layers) needs to know: the kernel, the relay's mesh dim and
    this rank's position in the relay order, the mesh dims to sum the weights' gradients over."""

    def __init__(self, kernel, args, mesh, time_dim, reverse, split_dims, time_axis):
        self.kernel, self.args, self.mesh = kernel, args, mesh
        self.time_dim, self.reverse, self.split_dims, self.time_axis = time_dim, reverse, split_dims, time_axis
        self.ranks = 1 if time_dim is None else mesh.size(time_dim)
        me = 0 if time_dim is None else mesh.get_coordinate()[time_dim]
        self.pos = self.ranks - 1 - me if reverse else me

    def run(self, x, states, weights):
        """The single-layer, single-direction kernel on this rank's rows from ``states``."""
        if x.shape[self.time_axis] == 0:  # no rows here: the state passes through unchanged
            shape = list(x.shape)
            shape[-1] = states[0].shape[-1]
            return x.new_zeros(shape), [s.clone() for s in states]
        if self.reverse:
            x = x.flip(self.time_axis)
        hx = tuple(states) if len(states) > 1 else states[0]
        res = getattr(torch._VF, self.kernel)(x, hx, list(weights), *self.args)
        out, final = res[0], list(res[1:])
        return (out.flip(self.time_axis) if self.reverse else out), final

    def relay(self, tensors, backwards):
        """Pass ``tensors`` one position on in the relay order (``backwards``: one position back)."""
        from .ring import ring_pass
        direction = "forward" if (self.reverse == backwards) else "backward"
        with torch.no_grad():
            return list(ring_pass([t.contiguous() for t in tensors], self.mesh, self.time_dim,
                                  recv_shapes=[t.shape for t in tensors], direction=direction))


def _grads(outputs, grad_outputs, inputs):
    """``torch.autograd.grad`` of the outputs that require grad, with respect to the inputs that do (zeros for the
    others: a rank without rows has outputs that depend on nothing)."""
    pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad]
    wanted = [t for t in inputs if t.requires_grad]
    found = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
                 if pairs and wanted else [None] * len(wanted))
    grads = [next(found) if t.requires_grad else None for t in inputs]
    return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, inputs)]


def _summed(tensors, mesh, dims):
    """Each of ``tensors`` summed over the ranks of the mesh dims ``dims``: one all-reduce for all of them."""
    flat = sum_over_mesh_dims(torch.cat([t.reshape(-1) for t in tensors]), mesh, dims)
    return [f.view_as(t) for f, t in zip(torch.split(flat, [t.numel() for t in tensors]), tensors)]


class _Relay(torch.autograd.Function):
    """A stack of ``layers`` layers of one direction over this rank's rows, as a wavefront along the relay order: at
    step ``s`` the rank at position ``p`` runs layer ``s - p``, from the state the rank before it ended that layer
    with one step earlier (its own previous layer's rows are its input). ``L + P - 1`` steps, one ring pass of one
    layer's state after each. Returns the last layer's output rows and every layer's final state (the last
    position's; zeros elsewhere). Backward runs the steps in reverse, relaying the states' gradients back."""

    @staticmethod
    def forward(ctx, plan, n_states, layers, x, *rest):
        n_init = layers * n_states
        states0 = [list(rest[k * n_states:(k + 1) * n_states]) for k in range(layers)]
        per = (len(rest) - n_init) // layers
        weights = [list(rest[n_init + k * per:n_init + (k + 1) * per]) for k in range(layers)]
        steps = layers + plan.ranks - 1
        with torch.enable_grad():
            w_leaf = [[w.detach().requires_grad_(w.requires_grad) for w in ws] for ws in weights]
            entering = [[s.detach() for s in ss] for ss in states0]
            inputs = [x.detach().requires_grad_(x.requires_grad)] + [None] * layers
            done = [None] * layers          # (output, final states, entering-state leaves) per layer
            for step in range(steps):
                k = step - plan.pos
                if 0 <= k < layers:
                    s_leaf = [s.detach().requires_grad_(True) for s in entering[k]]
                    out, final = plan.run(inputs[k], s_leaf, w_leaf[k])
                    done[k] = (out, final, s_leaf)
                    if k + 1 < layers:  # the next layer's input: its own leaf (each layer differentiated alone)
                        inputs[k + 1] = out.detach().requires_grad_(True)
                if plan.ranks > 1 and step < steps - 1:  # nothing to relay when every rank holds whole sequences
                    sent = ([f.detach() for f in done[k][1]] if 0 <= k < layers else
                            [torch.zeros_like(t) for t in states0[0]])
                    received = plan.relay(sent, backwards=False)
                    if plan.pos > 0 and 0 <= k + 1 < layers:  # the rank before ended layer k + 1 this step
                        entering[k + 1] = received
        ctx.plan, ctx.done, ctx.leaves = plan, done, (inputs, w_leaf)
        last = plan.pos == plan.ranks - 1
        finals = [(f.detach() if last else torch.zeros_like(f)) for _, final, _ in done for f in final]
        return (done[-1][0].detach(), *finals)

    @staticmethod
    def backward(ctx, g_out, *g_final):
        plan, done, (inputs, w_leaf) = ctx.plan, ctx.done, ctx.leaves
        layers, n_states = len(done), len(done[0][2])
        steps = layers + plan.ranks - 1
        g_end = [list(g_final[k * n_states:(k + 1) * n_states]) for k in range(layers)]  # used by the last position
        g_in = [None] * layers + [g_out]     # the gradient of each layer's output rows (layer k's: g_in[k + 1])
        g_entering, g_w = [None] * layers, [None] * layers
        for step in reversed(range(steps)):
            k = step - plan.pos
            if 0 <= k < layers:
                out, final, s_leaf = done[k]
                grads = _grads([out, *final], [g_in[k + 1], *g_end[k]], [inputs[k], *s_leaf, *w_leaf[k]])
                g_in[k], g_entering[k], g_w[k] = grads[0], grads[1:1 + n_states], grads[1 + n_states:]
            if plan.ranks > 1 and step > 0:
                sent = (g_entering[k] if 0 <= k < layers else
                        [torch.zeros_like(s) for s in done[0][2]])
                received = plan.relay(sent, backwards=True)
                if plan.pos < plan.ranks - 1 and 0 <= k - 1 < layers:  # the rank after began layer k - 1 this step
                    g_end[k - 1] = received
        # the initial states' gradients are position 0's: summed along the time split, every rank holds them
        n_init = layers * n_states
        g_states = [None] * n_init
        if any(ctx.needs_input_grad[4:4 + n_init]):  # the same on every rank
            time_dims = [] if plan.time_dim is None else [plan.time_dim]
            g_states = _summed([g if plan.pos == 0 else torch.zeros_like(g) for gs in g_entering for g in gs],
                               plan.mesh, time_dims)
        # the weights' gradients: every rank's term, summed over every mesh dim that splits the input (one all-reduce)
        flat_g = [g for gs in g_w for g in gs]
        if any(w.requires_grad for ws in w_leaf for w in ws):
            flat_g = _summed(flat_g, plan.mesh, plan.split_dims)
        return (None, None, None, g_in[0], *g_states, *flat_g)


def sharded_forward(module, input, hx):
    """The module's forward on a ShardTensor input, or None to run torch's own (see the module docstring)."""
    from . import (Replicate, Shard, device_mesh, from_local, is_shard_tensor, local_offsets, placements,
                   redistribute, sharding_shapes, to_local)
    from .placement import Partial
    mode = module.mode
    if hasattr(module, "_update_flat_weights"):  # as torch's forward does: parameters replaced since are picked up
        module._update_flat_weights()
    if mode not in _KERNELS or not isinstance(input, torch.Tensor) or input.dim() not in (2, 3):
        return None
    if module.dropout > 0 and module.training and module.num_layers > 1:
        return None  # dropout between layers: torch's own path draws its masks alike
    unbatched = input.dim() == 2
    batch_first = module.batch_first and not unbatched
    x = input.unsqueeze(1) if unbatched else input
    x = completed(x)
    pl = list(placements(x))
    t_axis, b_axis = (1, 0) if batch_first else (0, 1)
    if any(p.is_shard() and p.dim == 2 for p in pl):
        return None  # a split feature dim: the gates mix every feature
    lstm = mode == "LSTM"
    n_states = 2 if lstm else 1
    if hx is not None:
        states = list(hx) if lstm else [hx]
        if unbatched:
            states = [s.unsqueeze(1) for s in states]
        if any(not is_shard_tensor(s) and s.requires_grad for s in states):
            return None  # a learnable plain initial state: torch's own path sums its gradient
    mesh = device_mesh(x)
    shapes = sharding_shapes(x)
    time_dim = next((d for d, p in enumerate(pl) if p.is_shard() and p.dim == t_axis), None)
    split_dims = [d for d, p in enumerate(pl) if p.is_shard()]
    x_local = to_local(x)
    batch_first_row = local_offsets(x)[b_axis]
    batch_rows = x_local.shape[b_axis]
    d_count = 2 if module.bidirectional else 1
    hidden = [module.proj_size if (lstm and module.proj_size > 0) else module.hidden_size, module.hidden_size]

    # a state (L * D, B, H) split along batch like the input, whole along every other mesh dim
    state_pl = [Shard(1) if (p.is_shard() and p.dim == b_axis) else Replicate() for p in pl]
    state_shapes = {d: e for d, e in shapes.items() if pl[d].is_shard() and pl[d].dim == b_axis}

    def initial(i):
        """State ``i`` ((L * D, B_local, H)) on this rank's batch rows."""
        if hx is None:
            return x_local.new_zeros(module.num_layers * d_count, batch_rows, hidden[i])
        s = states[i]
        if is_shard_tensor(s):  # laid out like the input's batch rows (a redistribution when it is not)
            if list(placements(s)) != state_pl or any(sharding_shapes(s).get(d) != e for d, e in state_shapes.items()):
                s = redistribute(s, state_pl, sharding_shapes=state_shapes)
            return to_local(s)
        return s.narrow(1, batch_first_row, batch_rows)

    h0 = [initial(i) for i in range(n_states)]
    per = len(module._flat_weights) // (module.num_layers * d_count)
    args = (module.bias, 1, 0.0, module.training, False, batch_first)
    finals = [[] for _ in range(n_states)]

    def relay(layer_in, first, layers, direction):
        """Layers ``first .. first + layers - 1`` of one direction as one wavefront node; collects final states."""
        plan = _Plan(_KERNELS[mode], args, mesh, time_dim, direction == 1, split_dims, t_axis)
        index = [(first + j) * d_count + direction for j in range(layers)]
        res = _Relay.apply(plan, n_states, layers, layer_in, *[h[k:k + 1] for k in index for h in h0],
                           *[w for k in index for w in module._flat_weights[k * per:(k + 1) * per]])
        for j in range(layers):
            for i in range(n_states):
                finals[i].append(res[1 + j * n_states + i])
        return res[0]

    if d_count == 1:  # the whole stack in one wavefront: L + P - 1 steps, not L * P
        layer_in = relay(x_local, 0, module.num_layers, 0)
    else:  # each layer needs both directions' whole rows before the next
        layer_in = x_local
        for layer in range(module.num_layers):
            layer_in = torch.cat([relay(layer_in, layer, 1, direction) for direction in range(2)], dim=2)
    out = from_local(layer_in, mesh, pl, sharding_shapes=shapes, check=False)
    # final states: (L * D, B, H), batch split like the input, whole along time (the last position's, completed)
    st_pl = [Shard(1) if (p.is_shard() and p.dim == b_axis) else Partial() if d == time_dim else Replicate()
             for d, p in enumerate(pl)]
    final = [from_local(torch.cat(f, dim=0), mesh, st_pl, sharding_shapes=state_shapes, check=False) for f in finals]
    if time_dim is not None:
        final = [redistribute(f, state_pl) for f in final]
    if unbatched:
        out = out.squeeze(1)
        final = [f.squeeze(1) for f in final]
    return out, (tuple(final) if lstm else final[0])
