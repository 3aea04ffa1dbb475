//! Criterion micro-benchmark: the gateway's decoder of engine event streams
//! (`agentgate_adapters::sse::SseDecoder`), fed the way the network delivers bytes.
//!
//! - `chunks`: 2,000 vLLM-style chat-completion chunk events (about 230 bytes each), read
//!   1,448 bytes at a time (one TCP segment), as a streamed answer arrives.
//! - `one_large_event`: a single 4 MiB `data:` line (a large tool-call argument or a whole
//!   non-incremental answer) read 16 KiB at a time. The cost per read must not grow with the
//!   bytes already buffered.

use std::hint::black_box;
use std::time::Duration;

use agentgate_adapters::sse::SseDecoder;
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

fn chunk_stream(events: usize) -> Vec<u8> {
    let mut body = Vec::new();
    for i in 0..events {
        body.extend_from_slice(
            format!(
                "data: {{\"id\":\"chatcmpl-1\",\"object\":\"chat.completion.chunk\",\"created\":1,\
                 \"model\":\"sim-model\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":\
                 \"token{i} \"}},\"logprobs\":null,\"finish_reason\":null}}]}}\n\n"
            )
            .as_bytes(),
        );
    }
    body.extend_from_slice(b"data: [DONE]\n\n");
    body
}

fn large_event(bytes: usize) -> Vec<u8> {
    let mut body = b"data: {\"arguments\":\"".to_vec();
    body.resize(bytes, b'x');
    body.extend_from_slice(b"\"}\n\ndata: [DONE]\n\n");
    body
}

fn decode(body: &[u8], read: usize) -> usize {
    let mut decoder = SseDecoder::default();
    let mut payloads = 0;
    for piece in body.chunks(read) {
        payloads += decoder.push(black_box(piece)).map_or(0, |p| p.len());
    }
    payloads + usize::from(decoder.finish().is_some())
}

fn sse_decode(c: &mut Criterion) {
    let mut group = c.benchmark_group("engine_sse_decode");
    group.measurement_time(Duration::from_secs(5));
    let chunks = chunk_stream(2_000);
    group.throughput(Throughput::Bytes(chunks.len() as u64));
    group.bench_function("chunks", |b| b.iter(|| decode(&chunks, 1_448)));
    let large = large_event(4 << 20);
    group.throughput(Throughput::Bytes(large.len() as u64));
    group.sample_size(10);
    group.bench_function("one_large_event", |b| b.iter(|| decode(&large, 16 << 10)));
    group.finish();
}

criterion_group!(benches, sse_decode);
criterion_main!(benches);
