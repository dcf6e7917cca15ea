"""How server mode's weights travel (trainers/generation/vllm_client.py): cast to the server's dtype when it is
narrower (float32 weights to a bfloat16 server: half the bytes, rounded as the server's loader would round them),
and grouped into one flat buffer per bucket of one dtype instead of one broadcast per tensor. The transfer itself,
buckets included, is tests/integration/test_vllm_server.py's (the server's greedy completions equal a reference's
after an update)."""

import torch

from trainers.generation.weight_wire import host_buffer, plan_buckets, wire_tensor


def test_weights_for_a_narrower_server_travel_in_its_dtype():
    weight = torch.randn(64, 32)  # float32
    sent = wire_tensor(weight, torch.bfloat16)
    assert sent.dtype == torch.bfloat16
    assert sent.numel() * sent.element_size() == weight.numel() * weight.element_size() // 2
    # what the server would hold had it received float32: its bfloat16 parameter's copy_ rounds to nearest
    held = torch.empty(64, 32, dtype=torch.bfloat16).copy_(weight)
    assert torch.equal(sent, held)


def test_a_wider_server_an_unknown_one_and_integer_buffers_get_the_tensor_as_it_is():
    weight = torch.randn(8, 4, dtype=torch.bfloat16)
    assert wire_tensor(weight, torch.float32) is weight  # the server widens it exactly
    assert wire_tensor(weight, None) is weight
    positions = torch.arange(10)
    assert wire_tensor(positions, torch.bfloat16) is positions


def test_buckets_group_consecutive_tensors_of_one_dtype_up_to_the_size():
    kib = [torch.zeros(256) for _ in range(3)]  # 1 KiB each, float32
    tensors = [*kib, torch.zeros(8, dtype=torch.bfloat16), torch.zeros(2048), torch.zeros(16), torch.zeros(16)]
    assert plan_buckets(tensors, bucket_bytes=3 * 1024) == [[0, 1, 2], [3], [4], [5, 6]]
    assert plan_buckets(tensors, bucket_bytes=2 * 1024) == [[0, 1], [2], [3], [4], [5, 6]]
    assert plan_buckets([], bucket_bytes=1024) == []


def test_a_bucket_is_its_tensors_elements_one_after_the_other():
    tensors = [torch.randn(3, 4), torch.randn(5), torch.randn(2, 2, 2), torch.randn(())]
    flat = host_buffer(tensors)
    assert flat.shape == (12 + 5 + 8 + 1,) and flat.dtype == torch.float32
    offset = 0
    for tensor in tensors:  # as the server's worker splits it (trainers_vllm_worker.receive_weights)
        assert torch.equal(flat[offset:offset + tensor.numel()].view(tensor.shape), tensor)
        offset += tensor.numel()
    alone = torch.randn(4, 4).t()  # not contiguous
    assert torch.equal(host_buffer([alone]), alone) and host_buffer([alone]).is_contiguous()
