"""Kernels run into their output buffers (``out=``) where aten has such an
overload, and fall back to result-and-copy when a run would not write the
buffer as it is."""
import functools

import torch

from tessera_actors.execution.program import _Into, out_variant

aten = torch.ops.aten


def test_out_overloads_are_found_by_schema():
    assert out_variant(aten.mm.default) is aten.mm.out
    assert out_variant(aten.mul.Tensor) is aten.mul.out
    assert out_variant(aten.where.self) is aten.where.self_out
    assert out_variant(aten.arange.default) is None        # its out overload takes other arguments
    assert out_variant(aten.split.Tensor) is None          # many results


def test_a_kernel_into_its_buffer_gives_the_same_bits_as_its_result_copied():
    torch.manual_seed(0)
    a, b = torch.randn(33, 70), torch.randn(70, 19)
    arena = torch.zeros(33 * 19 * 4 + 64, dtype=torch.uint8)
    dst = torch.empty(0).set_(arena.untyped_storage(), 16, (33, 19), (19, 1))
    bound = {}
    run = _Into(aten.mm.out, (a, b), {}, dst, lambda: dst.copy_(aten.mm.default(a, b)), bound, 7)
    run()
    assert torch.equal(dst, aten.mm.default(a, b))
    dst.zero_()
    bound[7]()   # the program's table now calls the op's out= overload itself, no _Into in between
    assert isinstance(bound[7], functools.partial) and torch.equal(dst, aten.mm.default(a, b))
    assert dst.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()


def test_a_run_that_would_detach_the_buffer_falls_back_to_a_copy():
    arena = torch.zeros(64, dtype=torch.uint8)
    dst = torch.empty(0).set_(arena.untyped_storage(), 4, (3,), (1,))
    x = torch.tensor([1.0, 2.0, 3.0])

    def resizing(t, *, out):       # an out= op that reallocates its output
        out.resize_(1000)
        out.fill_(7.0)
    copies = []

    def copy():
        copies.append(1)
        dst.copy_(x * 2)
    bound = {}
    run = _Into(resizing, (x,), {}, dst, copy, bound, 0)
    run()
    bound[0]()
    assert copies == [1, 1] and dst.tolist() == [2.0, 4.0, 6.0]
    assert dst.storage_offset() == 4 and dst.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()
    assert arena.untyped_storage().nbytes() >= 28
    assert torch.equal(torch.empty(0).set_(arena.untyped_storage(), 4, (3,), (1,)), torch.tensor([2.0, 4.0, 6.0]))


def test_a_run_that_raises_falls_back_to_a_copy():
    dst = torch.zeros(2)

    def failing(*a, out):
        raise RuntimeError("no out= for this")
    bound = {}
    run = _Into(failing, (), {}, dst, lambda: dst.copy_(torch.tensor([5.0, 6.0])), bound, 0)
    run()
    assert dst.tolist() == [5.0, 6.0] and run.fn == run.copy and bound[0] == run.copy
