//! vLLM's KV-event stream: event types, msgpack encoding/decoding and the ZMQ PUB publisher.
//!
//! Wire format (what vLLM's `ZmqEventPublisher` sends): one ZMQ multipart message per batch,
//! `[topic, 8-byte big-endian sequence number, msgpack payload]`. The payload is vLLM's
//! `KVEventBatch` as `[ts: float64, [event, ...], dp_rank]`. Recent vLLM (0.32) encodes each event
//! as a msgpack map with a `type` tag and the fields in declaration order; older versions encode
//! a tagged positional array (`["BlockStored", block_hashes, parent, token_ids, block_size, ...]`).
//! [`encode_payload`] writes the map form; [`decode_payload`] accepts both and ignores fields it
//! does not know.
//!
//! Endpoint semantics follow vLLM: `tcp://host:port` with a specific host CONNECTS (the
//! subscriber binds that address); `tcp://*:port` (or an unspecified address such as
//! `tcp://0.0.0.0:port`) BINDS.

use std::fmt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use rmp::encode::{self as enc, ByteBuf};
use rmp::Marker;
use tokio::sync::mpsc;
use zeromq::{Socket, SocketEvent, SocketSend, ZmqMessage};

/// Storage medium vLLM reports for blocks in accelerator memory.
pub const MEDIUM_GPU: &str = "GPU";

/// Cache-spec kind vLLM reports for ordinary (full) attention layers.
pub const KV_CACHE_SPEC_FULL_ATTENTION: &str = "full_attention";

/// Longest a queued event waits before its batch is published.
pub const FLUSH_INTERVAL: Duration = Duration::from_millis(5);

/// Most events published in one frame; a fuller queue is split across frames.
pub const MAX_EVENTS_PER_FRAME: usize = 512;

/// Nesting depth beyond which a payload is rejected instead of parsed.
const MAX_DEPTH: usize = 32;

/// One KV-cache event, as vLLM publishes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KvEvent {
    /// Blocks became cached (full blocks only), chained under `parent_block_hash`.
    BlockStored {
        /// Hashes of the stored blocks, in chain order.
        block_hashes: Vec<u64>,
        /// Hash of the block preceding the first stored block, if any.
        parent_block_hash: Option<u64>,
        /// Token ids of all stored blocks, concatenated.
        token_ids: Vec<u32>,
        /// Tokens per block.
        block_size: u32,
    },
    /// Blocks were evicted from the cache.
    BlockRemoved {
        /// Hashes of the evicted blocks.
        block_hashes: Vec<u64>,
    },
    /// The whole cache was cleared.
    AllBlocksCleared,
}

/// One decoded payload: vLLM's `KVEventBatch`.
#[derive(Debug, Clone, PartialEq)]
pub struct KvEventBatch {
    /// Publish time, seconds since the Unix epoch.
    pub ts: f64,
    /// Events in the order the engine produced them.
    pub events: Vec<KvEvent>,
    /// Data-parallel rank of the publishing engine (absent in older vLLM versions).
    pub dp_rank: Option<u32>,
    /// `type` tags of events this decoder does not know; those events were skipped.
    pub skipped_event_types: Vec<String>,
}

/// Why a payload could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecodeError {
    /// The bytes are not valid msgpack (truncated, reserved marker, bad UTF-8, too deep).
    Msgpack(String),
    /// The msgpack is valid but does not have the shape of a vLLM `KVEventBatch`.
    Shape(String),
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeError::Msgpack(why) => write!(
                f,
                "KV-event payload is not valid msgpack ({why}); check that the third ZMQ frame is passed, not the topic or sequence frame"
            ),
            DecodeError::Shape(why) => write!(
                f,
                "KV-event payload is not a vLLM KVEventBatch ({why}); check the engine's vLLM version and kv-events config"
            ),
        }
    }
}

impl std::error::Error for DecodeError {}

// ---------------------------------------------------------------------------------------------
// Encoding
// ---------------------------------------------------------------------------------------------

/// Encode `[ts, [event, ...], dp_rank]` exactly as vLLM 0.32 does (events as `type`-tagged maps).
pub fn encode_payload(ts: f64, events: &[KvEvent], dp_rank: u32) -> Vec<u8> {
    let capacity = 16 + events.iter().map(encoded_size_hint).sum::<usize>();
    let mut buf = ByteBuf::with_capacity(capacity);
    // ByteBuf writes are infallible (its error type is `Infallible`).
    let _ = enc::write_array_len(&mut buf, 3);
    let _ = enc::write_f64(&mut buf, ts);
    let _ = enc::write_array_len(&mut buf, len_u32(events.len()));
    for event in events {
        encode_event(&mut buf, event);
    }
    let _ = enc::write_uint(&mut buf, u64::from(dp_rank));
    buf.into_vec()
}

fn encoded_size_hint(event: &KvEvent) -> usize {
    match event {
        KvEvent::BlockStored {
            block_hashes,
            token_ids,
            ..
        } => 200 + 10 * block_hashes.len() + 3 * token_ids.len(),
        KvEvent::BlockRemoved { block_hashes } => 60 + 9 * block_hashes.len(),
        KvEvent::AllBlocksCleared => 24,
    }
}

fn len_u32(len: usize) -> u32 {
    u32::try_from(len).unwrap_or(u32::MAX)
}

fn encode_event(buf: &mut ByteBuf, event: &KvEvent) {
    match event {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
        } => {
            let _ = enc::write_map_len(buf, 11);
            write_key(buf, "type", "BlockStored");
            let _ = enc::write_str(buf, "block_hashes");
            write_uint_array(buf, block_hashes.iter().copied(), block_hashes.len());
            let _ = enc::write_str(buf, "parent_block_hash");
            match parent_block_hash {
                Some(hash) => {
                    let _ = enc::write_uint(buf, *hash);
                }
                None => {
                    let _ = enc::write_nil(buf);
                }
            }
            let _ = enc::write_str(buf, "token_ids");
            write_uint_array(
                buf,
                token_ids.iter().map(|&t| u64::from(t)),
                token_ids.len(),
            );
            let _ = enc::write_str(buf, "block_size");
            let _ = enc::write_uint(buf, u64::from(*block_size));
            let _ = enc::write_str(buf, "lora_id");
            let _ = enc::write_nil(buf);
            write_key(buf, "medium", MEDIUM_GPU);
            let _ = enc::write_str(buf, "lora_name");
            let _ = enc::write_nil(buf);
            // One entry per block; `None` means the block hash had no extra keys.
            let _ = enc::write_str(buf, "extra_keys");
            let _ = enc::write_array_len(buf, len_u32(block_hashes.len()));
            for _ in block_hashes {
                let _ = enc::write_nil(buf);
            }
            let _ = enc::write_str(buf, "group_idx");
            let _ = enc::write_uint(buf, 0);
            write_key(buf, "kv_cache_spec_kind", KV_CACHE_SPEC_FULL_ATTENTION);
        }
        KvEvent::BlockRemoved { block_hashes } => {
            let _ = enc::write_map_len(buf, 4);
            write_key(buf, "type", "BlockRemoved");
            let _ = enc::write_str(buf, "block_hashes");
            write_uint_array(buf, block_hashes.iter().copied(), block_hashes.len());
            write_key(buf, "medium", MEDIUM_GPU);
            let _ = enc::write_str(buf, "group_idx");
            let _ = enc::write_uint(buf, 0);
        }
        KvEvent::AllBlocksCleared => {
            let _ = enc::write_map_len(buf, 1);
            write_key(buf, "type", "AllBlocksCleared");
        }
    }
}

fn write_key(buf: &mut ByteBuf, key: &str, value: &str) {
    let _ = enc::write_str(buf, key);
    let _ = enc::write_str(buf, value);
}

fn write_uint_array(buf: &mut ByteBuf, values: impl Iterator<Item = u64>, len: usize) {
    let _ = enc::write_array_len(buf, len_u32(len));
    for value in values {
        let _ = enc::write_uint(buf, value);
    }
}

// ---------------------------------------------------------------------------------------------
// Decoding
// ---------------------------------------------------------------------------------------------

/// A parsed msgpack value borrowing strings and binaries from the payload.
#[derive(Debug, Clone, PartialEq)]
enum Value<'a> {
    Nil,
    Bool(bool),
    Uint(u64),
    Int(i64),
    Float(f64),
    Str(&'a str),
    Bin(&'a [u8]),
    Array(Vec<Value<'a>>),
    Map(Vec<(Value<'a>, Value<'a>)>),
    Ext,
}

struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&end| end <= self.bytes.len())
            .ok_or_else(|| {
                DecodeError::Msgpack(format!(
                    "truncated: needed {n} bytes at offset {}, payload has {}",
                    self.pos,
                    self.bytes.len()
                ))
            })?;
        let out = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    fn be<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N)?);
        Ok(out)
    }

    fn len8(&mut self) -> Result<usize, DecodeError> {
        Ok(usize::from(self.be::<1>()?[0]))
    }

    fn len16(&mut self) -> Result<usize, DecodeError> {
        Ok(usize::from(u16::from_be_bytes(self.be()?)))
    }

    fn len32(&mut self) -> Result<usize, DecodeError> {
        usize::try_from(u32::from_be_bytes(self.be()?))
            .map_err(|_| DecodeError::Msgpack("length does not fit in memory".into()))
    }

    fn str(&mut self, len: usize) -> Result<Value<'a>, DecodeError> {
        let raw = self.take(len)?;
        std::str::from_utf8(raw)
            .map(Value::Str)
            .map_err(|e| DecodeError::Msgpack(format!("string is not UTF-8: {e}")))
    }

    fn array(&mut self, len: usize, depth: usize) -> Result<Value<'a>, DecodeError> {
        // Every element takes at least one byte, so a claimed length beyond the remaining
        // bytes is corrupt; checking first keeps a hostile length from reserving memory.
        self.check_remaining(len)?;
        let mut items = Vec::with_capacity(len);
        for _ in 0..len {
            items.push(self.value(depth + 1)?);
        }
        Ok(Value::Array(items))
    }

    fn map(&mut self, len: usize, depth: usize) -> Result<Value<'a>, DecodeError> {
        self.check_remaining(len.saturating_mul(2))?;
        let mut entries = Vec::with_capacity(len);
        for _ in 0..len {
            let key = self.value(depth + 1)?;
            let value = self.value(depth + 1)?;
            entries.push((key, value));
        }
        Ok(Value::Map(entries))
    }

    fn check_remaining(&self, min_bytes: usize) -> Result<(), DecodeError> {
        if min_bytes > self.bytes.len() - self.pos {
            return Err(DecodeError::Msgpack(format!(
                "truncated: container at offset {} claims {min_bytes} items",
                self.pos
            )));
        }
        Ok(())
    }

    fn value(&mut self, depth: usize) -> Result<Value<'a>, DecodeError> {
        if depth > MAX_DEPTH {
            return Err(DecodeError::Msgpack(format!(
                "nested deeper than {MAX_DEPTH} levels"
            )));
        }
        let marker = Marker::from_u8(self.be::<1>()?[0]);
        Ok(match marker {
            Marker::FixPos(v) => Value::Uint(u64::from(v)),
            Marker::FixNeg(v) => Value::Int(i64::from(v)),
            Marker::Null => Value::Nil,
            Marker::True => Value::Bool(true),
            Marker::False => Value::Bool(false),
            Marker::U8 => Value::Uint(u64::from(self.be::<1>()?[0])),
            Marker::U16 => Value::Uint(u64::from(u16::from_be_bytes(self.be()?))),
            Marker::U32 => Value::Uint(u64::from(u32::from_be_bytes(self.be()?))),
            Marker::U64 => Value::Uint(u64::from_be_bytes(self.be()?)),
            Marker::I8 => Value::Int(i64::from(i8::from_be_bytes(self.be()?))),
            Marker::I16 => Value::Int(i64::from(i16::from_be_bytes(self.be()?))),
            Marker::I32 => Value::Int(i64::from(i32::from_be_bytes(self.be()?))),
            Marker::I64 => Value::Int(i64::from_be_bytes(self.be()?)),
            Marker::F32 => Value::Float(f64::from(f32::from_be_bytes(self.be()?))),
            Marker::F64 => Value::Float(f64::from_be_bytes(self.be()?)),
            Marker::FixStr(len) => self.str(usize::from(len))?,
            Marker::Str8 => {
                let len = self.len8()?;
                self.str(len)?
            }
            Marker::Str16 => {
                let len = self.len16()?;
                self.str(len)?
            }
            Marker::Str32 => {
                let len = self.len32()?;
                self.str(len)?
            }
            Marker::Bin8 => {
                let len = self.len8()?;
                Value::Bin(self.take(len)?)
            }
            Marker::Bin16 => {
                let len = self.len16()?;
                Value::Bin(self.take(len)?)
            }
            Marker::Bin32 => {
                let len = self.len32()?;
                Value::Bin(self.take(len)?)
            }
            Marker::FixArray(len) => self.array(usize::from(len), depth)?,
            Marker::Array16 => {
                let len = self.len16()?;
                self.array(len, depth)?
            }
            Marker::Array32 => {
                let len = self.len32()?;
                self.array(len, depth)?
            }
            Marker::FixMap(len) => self.map(usize::from(len), depth)?,
            Marker::Map16 => {
                let len = self.len16()?;
                self.map(len, depth)?
            }
            Marker::Map32 => {
                let len = self.len32()?;
                self.map(len, depth)?
            }
            Marker::FixExt1 => self.ext(1)?,
            Marker::FixExt2 => self.ext(2)?,
            Marker::FixExt4 => self.ext(4)?,
            Marker::FixExt8 => self.ext(8)?,
            Marker::FixExt16 => self.ext(16)?,
            Marker::Ext8 => {
                let len = self.len8()?;
                self.ext(len)?
            }
            Marker::Ext16 => {
                let len = self.len16()?;
                self.ext(len)?
            }
            Marker::Ext32 => {
                let len = self.len32()?;
                self.ext(len)?
            }
            Marker::Reserved => {
                return Err(DecodeError::Msgpack(format!(
                    "reserved marker 0xc1 at offset {}",
                    self.pos - 1
                )))
            }
        })
    }

    fn ext(&mut self, len: usize) -> Result<Value<'a>, DecodeError> {
        self.take(1 + len)?;
        Ok(Value::Ext)
    }
}

/// Decode a vLLM `KVEventBatch` payload (the third frame), in map or tagged-array event form.
pub fn decode_payload(bytes: &[u8]) -> Result<KvEventBatch, DecodeError> {
    let mut reader = Reader { bytes, pos: 0 };
    let root = reader.value(0)?;
    if reader.pos != bytes.len() {
        return Err(DecodeError::Msgpack(format!(
            "{} trailing bytes after the payload",
            bytes.len() - reader.pos
        )));
    }
    let (ts, events, dp_rank) = match root {
        Value::Array(items) => {
            let mut items = items.into_iter();
            let ts = items.next();
            let events = items.next();
            let dp_rank = items.next();
            (ts, events, dp_rank)
        }
        // vLLM's batch struct without `array_like` encodes as a map keyed by field name.
        Value::Map(entries) => {
            let mut ts = None;
            let mut events = None;
            let mut dp_rank = None;
            for (key, value) in entries {
                match key {
                    Value::Str("ts") => ts = Some(value),
                    Value::Str("events") => events = Some(value),
                    Value::Str("data_parallel_rank") => dp_rank = Some(value),
                    _ => {}
                }
            }
            (ts, events, dp_rank)
        }
        other => {
            return Err(shape(format!(
                "expected [ts, events, dp_rank], found {}",
                kind(&other)
            )))
        }
    };
    let ts = match ts {
        Some(Value::Float(ts)) => ts,
        Some(Value::Uint(ts)) => ts as f64,
        Some(Value::Int(ts)) => ts as f64,
        other => {
            return Err(shape(format!(
                "ts must be a number, found {}",
                opt_kind(other.as_ref())
            )))
        }
    };
    let raw_events = match events {
        Some(Value::Array(events)) => events,
        other => {
            return Err(shape(format!(
                "events must be an array, found {}",
                opt_kind(other.as_ref())
            )))
        }
    };
    let dp_rank = match dp_rank {
        None | Some(Value::Nil) => None,
        Some(Value::Uint(rank)) => Some(
            u32::try_from(rank).map_err(|_| shape(format!("dp_rank {rank} is out of range")))?,
        ),
        Some(other) => {
            return Err(shape(format!(
                "dp_rank must be an unsigned integer, found {}",
                kind(&other)
            )))
        }
    };
    let mut batch = KvEventBatch {
        ts,
        events: Vec::with_capacity(raw_events.len()),
        dp_rank,
        skipped_event_types: Vec::new(),
    };
    for (index, raw) in raw_events.into_iter().enumerate() {
        match decode_event(raw).map_err(|e| prefix_error(e, index))? {
            Decoded::Event(event) => batch.events.push(event),
            Decoded::Unknown(tag) => batch.skipped_event_types.push(tag),
        }
    }
    Ok(batch)
}

enum Decoded {
    Event(KvEvent),
    Unknown(String),
}

/// Fields of one event, gathered from either the map form or the positional form.
#[derive(Default)]
struct EventFields<'a> {
    block_hashes: Option<Value<'a>>,
    parent_block_hash: Option<Value<'a>>,
    token_ids: Option<Value<'a>>,
    block_size: Option<Value<'a>>,
}

fn decode_event(raw: Value<'_>) -> Result<Decoded, DecodeError> {
    let (tag, fields) = match raw {
        Value::Map(entries) => {
            let mut tag = None;
            let mut fields = EventFields::default();
            for (key, value) in entries {
                match key {
                    Value::Str("type") => tag = Some(value),
                    Value::Str("block_hashes") => fields.block_hashes = Some(value),
                    Value::Str("parent_block_hash") => fields.parent_block_hash = Some(value),
                    Value::Str("token_ids") => fields.token_ids = Some(value),
                    Value::Str("block_size") => fields.block_size = Some(value),
                    _ => {}
                }
            }
            (tag, fields)
        }
        Value::Array(items) => {
            let mut items = items.into_iter();
            let tag = items.next();
            let mut fields = EventFields::default();
            match tag {
                Some(Value::Str("BlockStored")) => {
                    fields.block_hashes = items.next();
                    fields.parent_block_hash = items.next();
                    fields.token_ids = items.next();
                    fields.block_size = items.next();
                }
                Some(Value::Str("BlockRemoved")) => fields.block_hashes = items.next(),
                _ => {}
            }
            (tag, fields)
        }
        other => {
            return Err(shape(format!(
                "event must be a map or a tagged array, found {}",
                kind(&other)
            )))
        }
    };
    let tag = match tag {
        Some(Value::Str(tag)) => tag,
        other => {
            return Err(shape(format!(
                "event type tag must be a string, found {}",
                opt_kind(other.as_ref())
            )))
        }
    };
    let event = match tag {
        "BlockStored" => KvEvent::BlockStored {
            block_hashes: hash_list(fields.block_hashes, "block_hashes")?,
            parent_block_hash: match fields.parent_block_hash {
                None | Some(Value::Nil) => None,
                Some(value) => Some(block_hash(&value, "parent_block_hash")?),
            },
            token_ids: match fields.token_ids {
                None | Some(Value::Nil) => Vec::new(),
                Some(Value::Array(items)) => items
                    .iter()
                    .map(|item| small_uint(item, "token_ids"))
                    .collect::<Result<_, _>>()?,
                Some(other) => {
                    return Err(shape(format!(
                        "token_ids must be an array, found {}",
                        kind(&other)
                    )))
                }
            },
            block_size: match fields.block_size {
                Some(value) => small_uint(&value, "block_size")?,
                None => return Err(shape("BlockStored is missing block_size".into())),
            },
        },
        "BlockRemoved" => KvEvent::BlockRemoved {
            block_hashes: hash_list(fields.block_hashes, "block_hashes")?,
        },
        "AllBlocksCleared" => KvEvent::AllBlocksCleared,
        unknown => return Ok(Decoded::Unknown(unknown.to_owned())),
    };
    Ok(Decoded::Event(event))
}

fn hash_list(value: Option<Value<'_>>, field: &str) -> Result<Vec<u64>, DecodeError> {
    match value {
        Some(Value::Array(items)) => items.iter().map(|item| block_hash(item, field)).collect(),
        other => Err(shape(format!(
            "{field} must be an array, found {}",
            opt_kind(other.as_ref())
        ))),
    }
}

/// A block hash as u64: unsigned ints as is, negative ints (older vLLM's Python `hash()`) by
/// their two's-complement bits, byte strings by their low 64 bits read big-endian (the same
/// conversion vLLM applies when `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` is set).
fn block_hash(value: &Value<'_>, field: &str) -> Result<u64, DecodeError> {
    match value {
        Value::Uint(hash) => Ok(*hash),
        Value::Int(hash) => Ok(*hash as u64),
        Value::Bin(bytes) => {
            let tail = &bytes[bytes.len().saturating_sub(8)..];
            Ok(tail
                .iter()
                .fold(0u64, |acc, &byte| (acc << 8) | u64::from(byte)))
        }
        other => Err(shape(format!(
            "{field} entries must be integers or bytes, found {}",
            kind(other)
        ))),
    }
}

fn small_uint(value: &Value<'_>, field: &str) -> Result<u32, DecodeError> {
    match value {
        Value::Uint(v) => {
            u32::try_from(*v).map_err(|_| shape(format!("{field} value {v} is out of range")))
        }
        other => Err(shape(format!(
            "{field} must hold unsigned integers, found {}",
            kind(other)
        ))),
    }
}

fn shape(why: String) -> DecodeError {
    DecodeError::Shape(why)
}

fn prefix_error(error: DecodeError, index: usize) -> DecodeError {
    match error {
        DecodeError::Shape(why) => DecodeError::Shape(format!("event {index}: {why}")),
        other => other,
    }
}

fn kind(value: &Value<'_>) -> &'static str {
    match value {
        Value::Nil => "nil",
        Value::Bool(_) => "a boolean",
        Value::Uint(_) | Value::Int(_) => "an integer",
        Value::Float(_) => "a float",
        Value::Str(_) => "a string",
        Value::Bin(_) => "bytes",
        Value::Array(_) => "an array",
        Value::Map(_) => "a map",
        Value::Ext => "an extension value",
    }
}

fn opt_kind(value: Option<&Value<'_>>) -> &'static str {
    value.map_or("nothing", kind)
}

// ---------------------------------------------------------------------------------------------
// Publisher
// ---------------------------------------------------------------------------------------------

/// Events queued for publishing at most; beyond this (subscriber unreachable for long) new events
/// are dropped, as with vLLM's bounded publisher queue, instead of growing memory without bound.
pub const MAX_QUEUED_EVENTS: usize = 100_000;

/// Handle used by the cache model to publish events; cheap to clone, never blocks.
#[derive(Debug, Clone)]
pub struct KvEventSink {
    tx: mpsc::Sender<KvEvent>,
    dropped: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl KvEventSink {
    /// Queue one event for publishing; dropped (and counted) if the queue is full, ignored if the
    /// publisher has stopped.
    pub fn emit(&self, event: KvEvent) {
        if let Err(mpsc::error::TrySendError::Full(_)) = self.tx.try_send(event) {
            let before = self
                .dropped
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if before == 0 {
                tracing::warn!(
                    capacity = MAX_QUEUED_EVENTS,
                    "kv-events: publish queue full (is the subscriber reachable?); dropping events"
                );
            }
        }
    }

    /// Events dropped so far because the publish queue was full.
    pub fn dropped_events(&self) -> u64 {
        self.dropped.load(std::sync::atomic::Ordering::Relaxed)
    }
}

/// How the PUB socket reaches its subscribers.
enum Attach {
    /// Connect to a subscriber that binds this endpoint (`tcp://host:port`).
    Connect(String),
    /// Accept subscribers on an already-bound listener (`tcp://*:port`).
    Bind(std::net::TcpListener),
}

/// Parse a vLLM-style endpoint and, for bind endpoints, bind the port now so errors surface early.
fn attach_for(endpoint: &str) -> std::io::Result<Attach> {
    let invalid = |why: String| std::io::Error::new(std::io::ErrorKind::InvalidInput, why);
    let rest = endpoint.strip_prefix("tcp://").ok_or_else(|| {
        invalid(format!(
            "KV-event endpoint {endpoint:?} is not supported; use tcp://HOST:PORT (connect) or tcp://*:PORT (bind)"
        ))
    })?;
    let (host, port) = rest.rsplit_once(':').ok_or_else(|| {
        invalid(format!(
            "KV-event endpoint {endpoint:?} has no port; use tcp://HOST:PORT or tcp://*:PORT"
        ))
    })?;
    let port: u16 = port.parse().map_err(|_| {
        invalid(format!(
            "KV-event endpoint {endpoint:?} has an invalid port {port:?}"
        ))
    })?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let wildcard = match host {
        "*" => Some(std::net::IpAddr::from([0u8, 0, 0, 0])),
        "" => {
            return Err(invalid(format!(
                "KV-event endpoint {endpoint:?} has no host; use tcp://*:{port} to bind"
            )))
        }
        other => other
            .parse::<std::net::IpAddr>()
            .ok()
            .filter(|ip| ip.is_unspecified()),
    };
    match wildcard {
        Some(ip) => {
            let listener = std::net::TcpListener::bind((ip, port)).map_err(|e| {
                std::io::Error::new(
                    e.kind(),
                    format!("cannot bind KV-event endpoint {endpoint}: {e}; pick a free port"),
                )
            })?;
            Ok(Attach::Bind(listener))
        }
        None => Ok(Attach::Connect(format!("tcp://{}:{port}", rest_host(rest)))),
    }
}

/// The host part of `host:port`, brackets kept for IPv6 literals.
fn rest_host(rest: &str) -> &str {
    rest.rsplit_once(':').map_or(rest, |(host, _)| host)
}

/// Start a publisher task for `endpoint` (`tcp://host:port` connects, as vLLM does for a specific
/// address; `tcp://*:port` or `tcp://0.0.0.0:port` binds) on the current tokio runtime.
///
/// Events are batched: a frame goes out [`FLUSH_INTERVAL`] after its first event or once it
/// holds [`MAX_EVENTS_PER_FRAME`] events. Sequence numbers start at 0 and increase by one per
/// frame. When connecting, events queue until the subscriber is reached, and the connection is
/// re-established if it drops. The task ends once every [`KvEventSink`] clone is dropped.
pub fn start_publisher(endpoint: &str, topic: &str) -> std::io::Result<KvEventSink> {
    let runtime = tokio::runtime::Handle::try_current().map_err(|_| {
        std::io::Error::other("start_publisher must be called from inside a tokio runtime")
    })?;
    let attach = attach_for(endpoint)?;
    let (tx, rx) = mpsc::channel(MAX_QUEUED_EVENTS);
    let topic = Bytes::copy_from_slice(topic.as_bytes());
    runtime.spawn(run_publisher(attach, topic, rx));
    Ok(KvEventSink {
        tx,
        dropped: Default::default(),
    })
}

async fn run_publisher(attach: Attach, topic: Bytes, mut rx: mpsc::Receiver<KvEvent>) {
    let mut socket = zeromq::PubSocket::new();
    let mut monitor = socket.monitor();
    let connect_to = match attach {
        Attach::Bind(listener) => {
            if let Err(e) = listener.set_nonblocking(true) {
                tracing::error!(error = %e, "kv-events: cannot configure listener; events will not be published");
                return;
            }
            match socket.bind_listener(listener).await {
                Ok(bound) => tracing::info!(endpoint = %bound, "kv-events: publishing (bound)"),
                Err(e) => {
                    tracing::error!(error = %e, "kv-events: bind failed; events will not be published");
                    return;
                }
            }
            None
        }
        Attach::Connect(endpoint) => {
            connect_until_ok(&mut socket, &endpoint).await;
            Some(endpoint)
        }
    };

    let mut seq: u64 = 0;
    let mut batch: Vec<KvEvent> = Vec::new();
    loop {
        match rx.recv().await {
            Some(event) => batch.push(event),
            None => break,
        }
        let deadline = tokio::time::Instant::now() + FLUSH_INTERVAL;
        while batch.len() < MAX_EVENTS_PER_FRAME {
            match tokio::time::timeout_at(deadline, rx.recv()).await {
                Ok(Some(event)) => batch.push(event),
                Ok(None) | Err(_) => break,
            }
        }
        if let Some(endpoint) = &connect_to {
            let mut lost = false;
            while let Ok(event) = monitor.try_recv() {
                lost |= matches!(event, SocketEvent::Disconnected(_));
            }
            if lost {
                tracing::warn!(%endpoint, "kv-events: subscriber disconnected; reconnecting");
                connect_until_ok(&mut socket, endpoint).await;
            }
        }
        let payload = encode_payload(unix_now(), &batch, 0);
        let message = ZmqMessage::try_from(vec![
            topic.clone(),
            Bytes::copy_from_slice(&seq.to_be_bytes()),
            Bytes::from(payload),
        ]);
        if let Ok(message) = message {
            if let Err(e) = socket.send(message).await {
                tracing::warn!(error = %e, seq, "kv-events: send failed; frame dropped");
            }
        }
        seq += 1;
        batch.clear();
    }
    let _ = socket.close().await;
}

/// Connect, retrying (the subscriber may not be listening yet) until it succeeds.
async fn connect_until_ok(socket: &mut zeromq::PubSocket, endpoint: &str) {
    let mut delay = Duration::from_millis(100);
    loop {
        match socket.connect(endpoint).await {
            Ok(()) => {
                tracing::info!(%endpoint, "kv-events: publishing (connected)");
                return;
            }
            Err(e) => {
                tracing::warn!(%endpoint, error = %e, "kv-events: connect failed; is the subscriber bound to this address? retrying");
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(Duration::from_secs(5));
            }
        }
    }
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One fixture frame: the raw payload plus the fields of its single event, from `decoded`.
    struct FixtureFrame {
        payload: Vec<u8>,
        decoded: serde_json::Value,
    }

    fn shared_dir() -> std::path::PathBuf {
        match std::env::var_os("AGENTGATE_SHARED_DIR") {
            Some(dir) => dir.into(),
            None => std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared"),
        }
    }

    fn fixture_frames() -> Vec<FixtureFrame> {
        let path = shared_dir().join("fixtures/vllm_kv_events.jsonl");
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
            panic!(
                "cannot read {}: {e}; set AGENTGATE_SHARED_DIR to the shared folder",
                path.display()
            )
        });
        text.lines()
            .filter(|line| !line.trim().is_empty())
            .map(|line| {
                let frame: serde_json::Value = serde_json::from_str(line).expect("fixture line");
                let b64 = frame["payload_b64"].as_str().expect("payload_b64");
                FixtureFrame {
                    payload: base64_decode(b64),
                    decoded: frame["decoded"].clone(),
                }
            })
            .collect()
    }

    fn base64_decode(text: &str) -> Vec<u8> {
        let mut out = Vec::new();
        let mut acc = 0u32;
        let mut bits = 0;
        for c in text.bytes().filter(|&c| c != b'=') {
            let v = match c {
                b'A'..=b'Z' => c - b'A',
                b'a'..=b'z' => c - b'a' + 26,
                b'0'..=b'9' => c - b'0' + 52,
                b'+' => 62,
                b'/' => 63,
                _ => panic!("bad base64 byte {c}"),
            };
            acc = (acc << 6) | u32::from(v);
            bits += 6;
            if bits >= 8 {
                bits -= 8;
                out.push((acc >> bits) as u8);
            }
        }
        out
    }

    fn json_u64s(value: &serde_json::Value) -> Vec<u64> {
        value
            .as_array()
            .expect("array")
            .iter()
            .map(|v| v.as_u64().expect("u64"))
            .collect()
    }

    #[test]
    fn decodes_real_vllm_frames() {
        let frames = fixture_frames();
        assert_eq!(frames.len(), 2);
        for frame in &frames {
            let batch = decode_payload(&frame.payload).expect("fixture decodes");
            let expected = &frame.decoded;
            assert_eq!(batch.ts, expected[0].as_f64().expect("ts"));
            assert_eq!(batch.dp_rank, Some(0));
            assert!(batch.skipped_event_types.is_empty());
            let raw_event = &expected[1][0];
            assert_eq!(batch.events.len(), 1);
            let KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
            } = &batch.events[0]
            else {
                panic!("expected BlockStored, got {:?}", batch.events[0]);
            };
            assert_eq!(block_hashes, &json_u64s(&raw_event["block_hashes"]));
            assert_eq!(*parent_block_hash, raw_event["parent_block_hash"].as_u64());
            let tokens: Vec<u64> = token_ids.iter().map(|&t| u64::from(t)).collect();
            assert_eq!(tokens, json_u64s(&raw_event["token_ids"]));
            assert_eq!(
                u64::from(*block_size),
                raw_event["block_size"].as_u64().unwrap()
            );
        }
    }

    #[test]
    fn encoding_reproduces_real_vllm_bytes() {
        for frame in fixture_frames() {
            let batch = decode_payload(&frame.payload).expect("fixture decodes");
            let ours = encode_payload(batch.ts, &batch.events, batch.dp_rank.unwrap_or(0));
            assert_eq!(
                ours, frame.payload,
                "our encoding differs from vLLM's bytes"
            );
        }
    }

    #[test]
    fn round_trips_every_event_kind() {
        let events = vec![
            KvEvent::BlockStored {
                block_hashes: vec![u64::MAX, 1 << 63, 7],
                parent_block_hash: None,
                token_ids: (0..48).map(|i| i * 1000).collect(),
                block_size: 16,
            },
            KvEvent::BlockStored {
                block_hashes: vec![42],
                parent_block_hash: Some(0xdead_beef_dead_beef),
                token_ids: vec![1; 16],
                block_size: 16,
            },
            KvEvent::BlockRemoved {
                block_hashes: vec![u64::MAX, 0],
            },
            KvEvent::AllBlocksCleared,
        ];
        let bytes = encode_payload(1_700_000_000.25, &events, 3);
        let batch = decode_payload(&bytes).expect("own encoding decodes");
        assert_eq!(batch.ts, 1_700_000_000.25);
        assert_eq!(batch.dp_rank, Some(3));
        assert_eq!(batch.events, events);
    }

    #[test]
    fn empty_batch_round_trips() {
        let batch = decode_payload(&encode_payload(0.5, &[], 0)).expect("decodes");
        assert!(batch.events.is_empty());
    }

    /// Hand-built msgpack for the older tagged positional form, with extra trailing fields.
    fn array_form_payload() -> Vec<u8> {
        let mut buf = ByteBuf::new();
        let _ = enc::write_array_len(&mut buf, 2); // older batches had no dp_rank
        let _ = enc::write_f64(&mut buf, 12.5);
        let _ = enc::write_array_len(&mut buf, 4);
        // ["BlockStored", [h], parent, tokens, block_size, lora_id, medium, "future field"]
        let _ = enc::write_array_len(&mut buf, 8);
        let _ = enc::write_str(&mut buf, "BlockStored");
        let _ = enc::write_array_len(&mut buf, 2);
        let _ = enc::write_uint(&mut buf, 0xffff_0000_ffff_0000);
        let _ = enc::write_sint(&mut buf, -5); // older vLLM: signed Python hash()
        let _ = enc::write_uint(&mut buf, 99);
        let _ = enc::write_array_len(&mut buf, 4);
        for t in [10u64, 20, 30, 40] {
            let _ = enc::write_uint(&mut buf, t);
        }
        let _ = enc::write_uint(&mut buf, 2);
        let _ = enc::write_nil(&mut buf);
        let _ = enc::write_str(&mut buf, "GPU");
        let _ = enc::write_str(&mut buf, "future field");
        // ["BlockRemoved", [bin hash], medium]
        let _ = enc::write_array_len(&mut buf, 3);
        let _ = enc::write_str(&mut buf, "BlockRemoved");
        let _ = enc::write_array_len(&mut buf, 1);
        let _ = enc::write_bin(&mut buf, &[9, 9, 0, 0, 0, 0, 0, 0, 1, 2]);
        let _ = enc::write_nil(&mut buf);
        // ["AllBlocksCleared"]
        let _ = enc::write_array_len(&mut buf, 1);
        let _ = enc::write_str(&mut buf, "AllBlocksCleared");
        // an event type this decoder does not know
        let _ = enc::write_array_len(&mut buf, 2);
        let _ = enc::write_str(&mut buf, "BlockPinned");
        let _ = enc::write_uint(&mut buf, 1);
        buf.into_vec()
    }

    #[test]
    fn decodes_tagged_array_form_and_skips_unknown() {
        let batch = decode_payload(&array_form_payload()).expect("array form decodes");
        assert_eq!(batch.ts, 12.5);
        assert_eq!(batch.dp_rank, None);
        assert_eq!(
            batch.events,
            vec![
                KvEvent::BlockStored {
                    block_hashes: vec![0xffff_0000_ffff_0000, (-5i64) as u64],
                    parent_block_hash: Some(99),
                    token_ids: vec![10, 20, 30, 40],
                    block_size: 2,
                },
                KvEvent::BlockRemoved {
                    block_hashes: vec![0x0000_0000_0000_0102],
                },
                KvEvent::AllBlocksCleared,
            ]
        );
        assert_eq!(batch.skipped_event_types, vec!["BlockPinned".to_owned()]);
    }

    #[test]
    fn map_form_ignores_unknown_fields_in_any_order() {
        let mut buf = ByteBuf::new();
        let _ = enc::write_array_len(&mut buf, 3);
        let _ = enc::write_f64(&mut buf, 1.0);
        let _ = enc::write_array_len(&mut buf, 1);
        let _ = enc::write_map_len(&mut buf, 4);
        write_key(&mut buf, "medium", "CPU");
        let _ = enc::write_str(&mut buf, "block_hashes");
        write_uint_array(&mut buf, [5u64, 6].into_iter(), 2);
        let _ = enc::write_str(&mut buf, "new_field");
        let _ = enc::write_map_len(&mut buf, 0);
        write_key(&mut buf, "type", "BlockRemoved");
        let _ = enc::write_uint(&mut buf, 1);
        let batch = decode_payload(&buf.into_vec()).expect("decodes");
        assert_eq!(
            batch.events,
            vec![KvEvent::BlockRemoved {
                block_hashes: vec![5, 6]
            }]
        );
    }

    #[test]
    fn rejects_malformed_payloads_with_errors() {
        let good = encode_payload(
            1.0,
            &[KvEvent::BlockRemoved {
                block_hashes: vec![1, 2, 3],
            }],
            0,
        );
        for cut in 0..good.len() {
            assert!(
                decode_payload(&good[..cut]).is_err(),
                "truncated at {cut} must fail"
            );
        }
        assert!(matches!(
            decode_payload(&[0xc1]),
            Err(DecodeError::Msgpack(_))
        ));
        // A huge claimed array length must fail fast rather than allocate.
        assert!(decode_payload(&[0xdd, 0xff, 0xff, 0xff, 0xff]).is_err());
        // Valid msgpack, wrong shape.
        assert!(matches!(
            decode_payload(&[0x93, 0xc0, 0x90, 0x00]),
            Err(DecodeError::Shape(_))
        ));
        let mut nested = vec![0x91; 100];
        nested.push(0xc0);
        assert!(decode_payload(&nested).is_err());
    }

    #[test]
    fn endpoints_follow_vllm_bind_connect_rule() {
        assert!(matches!(
            attach_for("tcp://127.0.0.1:5557"),
            Ok(Attach::Connect(ep)) if ep == "tcp://127.0.0.1:5557"
        ));
        assert!(matches!(
            attach_for("tcp://localhost:5557"),
            Ok(Attach::Connect(_))
        ));
        assert!(matches!(attach_for("tcp://*:0"), Ok(Attach::Bind(_))));
        assert!(matches!(attach_for("tcp://0.0.0.0:0"), Ok(Attach::Bind(_))));
        assert!(attach_for("ipc:///tmp/kv").is_err());
        assert!(attach_for("tcp://127.0.0.1").is_err());
        assert!(attach_for("tcp://127.0.0.1:notaport").is_err());
    }

    #[tokio::test]
    async fn full_queue_drops_and_counts_instead_of_growing() {
        // Nobody listens on this port, so the publisher keeps trying to connect and never drains.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("free port")
            .port();
        let sink = start_publisher(&format!("tcp://127.0.0.1:{port}"), "").expect("start");
        for _ in 0..MAX_QUEUED_EVENTS + 10 {
            sink.emit(KvEvent::AllBlocksCleared);
        }
        assert_eq!(sink.dropped_events(), 10);
    }

    #[test]
    fn start_publisher_outside_a_runtime_is_an_error() {
        assert!(start_publisher("tcp://*:0", "").is_err());
    }

    #[tokio::test]
    async fn publisher_sends_batched_frames_with_consecutive_sequence_numbers() {
        use zeromq::SocketRecv;
        let mut sub = zeromq::SubSocket::new();
        let bound = sub.bind("tcp://127.0.0.1:0").await.expect("bind sub");
        sub.subscribe("kv").await.expect("subscribe");
        let sink = start_publisher(&bound.to_string(), "kv").expect("start publisher");
        // Keep emitting probe events until the subscription has propagated and frames arrive;
        // the publisher connects in the background, as vLLM's does.
        let mut first = None;
        for _ in 0..200 {
            sink.emit(KvEvent::AllBlocksCleared);
            match tokio::time::timeout(Duration::from_millis(50), sub.recv()).await {
                Ok(Ok(message)) => {
                    first = Some(message);
                    break;
                }
                _ => continue,
            }
        }
        let first = first.expect("publisher frames reach the subscriber");
        assert_eq!(first.len(), 3);
        let mut last_seq = u64::from_be_bytes(
            first.get(1).expect("seq frame")[..]
                .try_into()
                .expect("8 bytes"),
        );
        // Now a burst: many events must arrive in far fewer frames, in order.
        let burst: Vec<KvEvent> = (0..2000u64)
            .map(|i| KvEvent::BlockRemoved {
                block_hashes: vec![i],
            })
            .collect();
        for event in &burst {
            sink.emit(event.clone());
        }
        let mut received = Vec::new();
        let mut frames = 0;
        while received.len() < burst.len() {
            let message = sub.recv().await.expect("frame");
            let seq = u64::from_be_bytes(message.get(1).expect("seq")[..].try_into().expect("8"));
            assert_eq!(
                seq,
                last_seq + 1,
                "sequence numbers increase by one per frame"
            );
            last_seq = seq;
            assert_eq!(message.get(0).map(|t| &t[..]), Some(&b"kv"[..]));
            let batch = decode_payload(message.get(2).expect("payload")).expect("decodes");
            received.extend(
                batch
                    .events
                    .into_iter()
                    .filter(|e| !matches!(e, KvEvent::AllBlocksCleared)),
            );
            frames += 1;
        }
        assert_eq!(received, burst);
        assert!(
            frames < burst.len() / 2,
            "events are batched ({frames} frames)"
        );
    }
}
