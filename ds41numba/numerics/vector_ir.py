"""The one toolkit every LLVM-IR micro-kernel builds from (:mod:`.bf16_dot`, :mod:`.int8_dot`,
:mod:`.amx_dot`, :mod:`.f32_tiles`, sparse attention): numba has no vector types, so those
kernels address their 2-D operands by hand. Loops (:func:`open_loop` / :func:`close_loop`, and
:func:`counted_loop` carrying values), splats, lane masks, prefetches and the unroll hint.
"""

from __future__ import annotations

import functools

import llvmlite.binding as llb
import llvmlite.ir as ir
import numba
from numba import types
from numba.core import cgutils

__all__ = ["I32", "I64", "F32", "V16I", "V16F", "V8I", "V8F", "compiles_for", "wide_registers", "row_operands",
           "row_pointer", "load_row", "extent", "i64", "splat", "lane_masks", "open_loop", "close_loop",
           "counted_loop", "broadcast_tile", "not_unrolled", "prefetch", "KeyQuarters", "key_vector"]

I32, I64, F32 = ir.IntType(32), ir.IntType(64), ir.FloatType()
V16I, V16F = ir.VectorType(I32, 16), ir.VectorType(F32, 16)
# One AVX2 register of int32 or f32 lanes.
V8I, V8F = ir.VectorType(I32, 8), ir.VectorType(F32, 8)


def compiles_for(feature: str) -> bool:
    """Whether numba compiles for a CPU with the LLVM feature ``feature`` (``"avx512bf16"``):
    the host CPU has it and numba's target is the host, its features not overridden without it.

    A named target (``NUMBA_CPU_NAME=haswell``: the AVX2 machines' code paths on a bigger CPU)
    is taken to have AVX2 alone, and only when LLVM knows it does (:func:`_named_cpu_has_avx2`):
    its other features are not probed, so the AVX-512 tiers stay off there."""
    overridden = numba.config.CPU_FEATURES
    if overridden is not None and f"+{feature}" not in overridden.split(","):
        return False
    if not _host_features().get(feature, False):
        return False
    name = numba.config.CPU_NAME
    return name in (None, "host") or (feature == "avx2" and _named_cpu_has_avx2(name))


@functools.cache
def _host_features():
    """The host CPU's LLVM features, asked once: each ask costs about 0.2 ms (llvmlite reads
    them anew), and :func:`~.backend.use_backend` asks for up to five."""
    return llb.get_host_cpu_features()


def _named_cpu_has_avx2(name: str) -> bool:
    """Whether LLVM compiles an add of eight int32 lanes for CPU ``name`` as one 256-bit
    instruction, which only AVX2 has (AVX's 256-bit registers hold floats alone). llvmlite tells
    a named CPU's features no other way."""
    if name not in _named_avx2:
        llb.initialize_native_target()
        llb.initialize_native_asmprinter()
        mod = llb.parse_assembly("define <8 x i32> @f(<8 x i32> %a, <8 x i32> %b) {\n"
                                 "  %c = add <8 x i32> %a, %b\n  ret <8 x i32> %c\n}\n")
        machine = llb.Target.from_default_triple().create_target_machine(cpu=name, features="")
        _named_avx2[name] = "vpaddd\t%ymm" in machine.emit_assembly(mod)
    return _named_avx2[name]


_named_avx2: dict = {}


def wide_registers() -> bool:
    """Whether numba compiles for a CPU with AVX-512's 32 vector registers of 16 floats; else
    (AVX2) there are 16 of 8. The micro-kernels size their tiles of sums by it, so the sums stay
    in registers: a 16-lane vector of the IR takes two of AVX2's. Only which sums share a loop
    changes with it, never how one is summed."""
    return compiles_for("avx512f")


def row_operands(context, builder, signature, args):
    """Per array argument, ``(address of its data as an i64, its first axis' stride in bytes)``,
    and the arrays themselves (for their shapes: :func:`extent`); a scalar argument is passed
    through as its value (its array None). Each row must be contiguous; rows may lie apart."""
    operands, arrays = [], []
    for t, v in zip(signature.args, args):
        if not isinstance(t, types.Array):
            operands.append(v)
            arrays.append(None)
            continue
        ary = context.make_array(t)(context, builder, v)
        operands.append((builder.ptrtoint(ary.data, I64), builder.extract_value(ary.strides, 0)))
        arrays.append(ary)
    return operands, arrays


def extent(builder, array, axis=0):
    """The length of ``array`` (one of :func:`row_operands`' arrays) along ``axis``, an i64."""
    return builder.extract_value(array.shape, axis)


def row_pointer(builder, operand, row, offset, ty):
    """A pointer to ``ty`` at byte ``offset`` of row ``row`` (both i64) of a row operand."""
    base, row_stride = operand
    addr = builder.add(base, builder.add(builder.mul(row_stride, row), offset))
    return builder.inttoptr(addr, ty.as_pointer())


def load_row(builder, operand, row, offset, ty):
    """The ``ty`` at byte ``offset`` of row ``row`` of a row operand (:func:`row_pointer`),
    loaded with 4-byte alignment (the operands' rows are f32 / int32 arrays)."""
    return builder.load(row_pointer(builder, operand, row, offset, ty), align=4)


class KeyQuarters:
    """A key operand gathered from four places: quarters of key blocks (8 keys each, from
    anywhere in the packed keys), each a row operand (address of its first key's row 0, row
    stride). Its vector ``v`` of 16 keys is quarters ``2v`` and ``2v + 1`` side by side: a
    kernel reads them as it reads one block's keys (:func:`key_vector`)."""

    def __init__(self, quarters):
        self.quarters = quarters

    def vector(self, builder, row, v, ty):
        half = ir.VectorType(ty.element, ty.count // 2)
        lo, hi = (load_row(builder, self.quarters[2 * v + i], row, i64(0), half) for i in range(2))
        return builder.shuffle_vector(lo, hi, ir.Constant(ir.VectorType(I32, ty.count),
                                                          list(range(ty.count))))


def key_vector(builder, b_op, row, v, ty):
    """Vector ``v`` (keys ``16v ..``, of type ``ty``) of row ``row`` of a key operand: a key
    block's row operand, or :class:`KeyQuarters`."""
    if isinstance(b_op, KeyQuarters):
        return b_op.vector(builder, row, v, ty)
    return load_row(builder, b_op, row, i64(64 * v), ty)


def i64(v):
    """The i64 constant ``v``."""
    return ir.Constant(I64, v)


def prefetch(builder, ptr):
    """A hint to read the cache line at ``ptr`` (any pointer) into L1 (``prefetcht0``). It never
    faults, so it may point past the end of an array."""
    i8p = ir.IntType(8).as_pointer()
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [i8p, I32, I32, I32]), "llvm.prefetch.p0i8")
    read, highest_locality, data = (ir.Constant(I32, v) for v in (0, 3, 1))
    builder.call(fn, [builder.bitcast(ptr, i8p), read, highest_locality, data])


def splat(builder, value, vty):
    """``value`` in every lane of a vector of type ``vty`` (its element's type)."""
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), value, ir.Constant(I32, 0))
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, vty.count), None))


def lane_masks(builder, width, n_vectors):
    """Per 16-lane vector ``v < n_vectors``, the i1 mask of its lanes ``16 * v + l`` below
    ``width`` (an i64): which lanes of a row ``width`` long a masked load may read."""
    lane = ir.Constant(ir.VectorType(I64, 16), list(range(16)))
    limit = splat(builder, width, ir.VectorType(I64, 16))
    return [builder.icmp_signed("<", builder.add(lane, ir.Constant(lane.type, [16 * v] * 16)), limit)
            for v in range(n_vectors)]


def counted_loop(builder, n, inits, body, name="loop", unrolled=True):
    """``for i in range(n): values = body(i, values)`` from ``inits``; returns the final values
    (``inits`` when ``n`` <= 0). ``body`` emits straight-line code and returns as many values as
    it is given (the loop's phis: a tile of sums carried in registers). ``unrolled=False`` marks
    the loop with :func:`not_unrolled`."""
    pre = builder.basic_block
    loop = builder.append_basic_block(name)
    done = builder.append_basic_block(f"{name}.done")
    builder.cbranch(builder.icmp_signed(">", n, i64(0)), loop, done)
    builder.position_at_end(loop)
    i = builder.phi(I64)
    i.add_incoming(i64(0), pre)
    phis = [builder.phi(v.type) for v in inits]
    for p, v in zip(phis, inits):
        p.add_incoming(v, pre)
    new = body(i, phis)
    end = builder.basic_block
    i_next = builder.add(i, i64(1))
    i.add_incoming(i_next, end)
    for p, v in zip(phis, new):
        p.add_incoming(v, end)
    back = builder.cbranch(builder.icmp_signed("<", i_next, n), loop, done)
    if not unrolled:
        not_unrolled(back)
    builder.position_at_end(done)
    outs = []
    for v, w in zip(inits, new):
        p = builder.phi(v.type)
        p.add_incoming(v, pre)
        p.add_incoming(w, end)
        outs.append(p)
    return outs


def broadcast_tile(builder, n, rows, nvec, load_a, load_b, update, name="tile", unrolled=True):
    """A register tile of ``rows`` x ``nvec`` 16-lane float sums over ``n`` steps from +0: at step
    ``k``, ``b = load_b(k)`` (``nvec`` vectors) and, row by row, the element ``load_a(k, i)``
    in every lane: ``acc[i][v] = update(a, b[v], acc[i][v])``. Returns the sums, ``rows``
    lists of ``nvec``. The f32 products' and sparse attention's micro-kernels are this loop,
    MKL's blocked kernel its FMA instance (:func:`~.f32_tiles.fma_sums`)."""
    def step(k, acc):
        bv = load_b(k)
        new = []
        for i in range(rows):
            a = splat(builder, load_a(k, i), V16F)
            new += [update(a, bv[v], acc[i * nvec + v]) for v in range(nvec)]
        return new

    zero = ir.Constant(V16F, None)
    flat = counted_loop(builder, n, [zero] * (rows * nvec), step, name, unrolled)
    return [flat[i * nvec:(i + 1) * nvec] for i in range(rows)]


def open_loop(builder, name):
    """Start a loop of one or more iterations: returns ``(i, entry)``, the i64 counter (from 0)
    and the block the loop is entered from, with the builder inside the loop's body."""
    entry = builder.basic_block
    body = builder.append_basic_block(f"{name}.loop")
    builder.branch(body)
    builder.position_at_end(body)
    i = builder.phi(I64)
    i.add_incoming(i64(0), entry)
    return i, entry


def close_loop(builder, i, n, name):
    """End the loop of counter ``i`` (:func:`open_loop`) after ``n`` iterations; the builder
    continues after it. The body may hold loops of its own: the branch back goes to the block
    holding ``i``, from wherever the body ends."""
    latch = builder.basic_block
    done = builder.append_basic_block(f"{name}.done")
    i_next = builder.add(i, i64(1))
    i.add_incoming(i_next, latch)
    back = builder.cbranch(builder.icmp_signed("<", i_next, n), i.parent, done)
    not_unrolled(back)
    builder.position_at_end(done)


class _LoopId(ir.values.MDValue):
    """A loop's metadata node, ``!N = distinct !{!N, hints...}``: LLVM reads a loop's hints only
    from a node whose first operand is itself."""

    def descr(self, buf):
        hints = ", ".join(op.get_reference() for op in self.operands)
        buf += (f"distinct !{{ {self.get_reference()}, {hints} }}", "\n")

    __hash__ = object.__hash__
    __eq__ = object.__eq__
    __ne__ = object.__ne__


def not_unrolled(branch):
    """On AVX2, mark ``branch``, a loop's branch back to its start, so LLVM does not unroll the
    loop.

    The micro-kernels' loops keep every sum in a register from one step to the next; unrolled
    (LLVM does so at numba's optimisation level), two steps' operands no longer fit beside
    them in AVX2's 16 registers and the sums spilled to the stack at every step (sparse
    attention's q.k tile at a third of the FMA rate, measured). AVX-512's 32 registers have
    room for both: its kernels stay as they were measured."""
    if wide_registers():
        return
    module = branch.parent.parent.module
    disable = module.add_metadata([ir.MetaDataString(module, "llvm.loop.unroll.disable")])
    branch.set_metadata("llvm.loop", _LoopId(module, [disable], name=str(len(module.metadata))))
