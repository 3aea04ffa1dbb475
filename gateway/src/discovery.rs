//! Endpoint discovery: endpoints a pool learns about at run time, beside the fixed ones from the
//! config's `endpoints` and `[pools.simulate]`.
//!
//! # Sources
//!
//! A [`Discovery`] source yields whole endpoint lists ([`Update::Endpoints`]) or says why it
//! could not produce one ([`Update::Failed`]; the pool keeps its current list). Today's source
//! is [`FileDiscovery`], a watched file; a Kubernetes source (EndpointSlices of a Service or
//! pods by label selector) implements the same trait and needs nothing else changed.
//!
//! # The endpoints file
//!
//! The shape of llm-d's static endpoint lists, in YAML (JSON, being a subset, parses too):
//!
//! ```yaml
//! endpoints:
//!   - name: vllm-a            # unique in the pool; shown in logs, metrics and session pins
//!     address: 10.0.0.5       # host name, IPv4 or IPv6 address
//!     port: 8000
//!     labels:                 # optional; merged over the pool's `labels`
//!       llm-d.ai/role: decode # optional; overrides the pool's `role` (both|prefill|decode)
//!       zone: us-east-1a
//! ```
//!
//! Unknown keys, duplicate names, names taken by the pool's fixed endpoints, an engine listed
//! twice (two entries, or an entry and a fixed endpoint, at one address and port), an empty
//! file and a bad role are errors: the whole file is refused and the pool keeps its current list, so a
//! half-written or mistyped file never empties a pool. To empty one, write `endpoints: []`.
//! The file is polled every `routing.discovery_interval_ms` for a change of modification time,
//! length, inode or status-change time ([`FileStamp`]; no file-system notification needed);
//! a change is read once the file has kept the same stamp for a whole interval, and again
//! later if it changed while it was read, so a file written in place is read whole. Writers
//! should still replace it atomically (write a temporary file, then rename it over the old
//! one). A file that cannot be read for now (no permission yet, out of file descriptors) is
//! tried again at every poll until it can, with one warning per reason.
//!
//! # Applying a new list (see [`diff`])
//!
//! Endpoints are matched by name:
//!
//! - **unchanged** (same name, address, port, role and labels): the same `Arc<Endpoint>` stays,
//!   so its in-flight counts, health streak and load report carry on;
//! - **relabelled** (same name and address, new role or labels): the same engine, so the new
//!   endpoint takes the old one's slot (the prefix index keeps what it learnt) and shares its
//!   live state: the requests in flight on the old object (they hold it until they end) count
//!   on the new one, and so do its health verdict, scraped load, KV capacity, working set and
//!   measured prefill throughput; the old one is retired;
//! - **renamed** (a new name at the address of an endpoint that goes, or went and still has
//!   requests in flight): the same engine under another name, handled as a relabel; sessions
//!   pinned to it stay (pins follow the engine's URL) and take the new name;
//! - **added** (or moved to another address): a new endpoint in a fresh slot, the lowest slot
//!   not held by a live endpoint nor by a removed one that still has requests in flight. A slot
//!   freed earlier is reused so per-slot tables stay small; the prefix index forgets what it
//!   knew for a reused slot before the new endpoint takes it;
//! - **removed**: [`Endpoint::retire`]d and left out of the next snapshot. Requests already
//!   running on it hold their own `Arc` and finish normally; new requests never see it.
//!
//! The pool's endpoint list is a snapshot swapped whole, so a request routes over one
//! consistent list while the next one sees the new list.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::Deserialize;
use serde_json::Value;

use agentgate_scheduler::{Endpoint, Role};

use crate::config::{engine_of, FileStamp};

/// The label that sets an endpoint's role, as llm-d's deployments label their pods.
pub const ROLE_LABEL: &str = "llm-d.ai/role";

/// Largest endpoints file read, in bytes.
const MAX_FILE_BYTES: u64 = 16 * 1024 * 1024;

/// Deepest YAML nesting accepted (the format itself needs four levels).
const MAX_DEPTH: usize = 32;

/// One endpoint as a discovery source describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiscoveredEndpoint {
    /// Unique name within the pool.
    pub name: String,
    /// Host name or IP address.
    pub address: String,
    /// TCP port.
    pub port: u16,
    /// Free-form labels; [`ROLE_LABEL`] sets the role.
    pub labels: BTreeMap<String, String>,
}

impl DiscoveredEndpoint {
    /// `http://address:port` (IPv6 addresses in brackets), the address in its one written
    /// form (a host name in lower case, an IPv6 address compressed), so the same engine
    /// written two ways in two versions of the file is one endpoint: it keeps its slot, its
    /// load and its pinned sessions.
    pub fn base_url(&self) -> String {
        let written = if self.address.contains(':') && !self.address.starts_with('[') {
            format!("http://[{}]:{}", self.address, self.port)
        } else {
            format!("http://{}:{}", self.address, self.port)
        };
        match reqwest::Url::parse(&written) {
            Ok(url) => match url.host_str() {
                Some(host) => format!("http://{}:{}", host.to_ascii_lowercase(), self.port),
                None => written,
            },
            Err(_) => written,
        }
    }

    /// The role its [`ROLE_LABEL`] names (`prefill-decode` is accepted for `both`), else
    /// `default`.
    pub fn role(&self, default: Role) -> Result<Role, String> {
        match self.labels.get(ROLE_LABEL).map(|r| r.trim()) {
            None => Ok(default),
            Some("prefill-decode") => Ok(Role::Both),
            Some(name) => Role::parse(name).map_err(|e| {
                format!(
                    "endpoint `{}`: label {ROLE_LABEL}: {e} (or prefill-decode)",
                    self.name
                )
            }),
        }
    }
}

/// What a discovery source produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Update {
    /// The complete new endpoint list.
    Endpoints(Vec<DiscoveredEndpoint>),
    /// The source could not be read or parsed; the pool keeps its current list.
    Failed(String),
}

/// A source of endpoint lists for one pool: a watched file today, Kubernetes later.
pub trait Discovery: Send + 'static {
    /// What the source watches, for logs (`file /etc/agentgate/endpoints.yaml`).
    fn describe(&self) -> String;

    /// Wait until the source changes and return the new list (or why it cannot be read).
    /// Cancel-safe: dropping the future loses no change.
    fn next(&mut self) -> impl Future<Output = Update> + Send;
}

/// The file as last seen, or that it was missing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stamp {
    Missing,
    Present(FileStamp),
}

/// Watches an endpoints file: polls its [`FileStamp`], re-reads it when that changes.
#[derive(Debug)]
pub struct FileDiscovery {
    path: PathBuf,
    interval: Duration,
    seen: Option<Stamp>,
    /// The last read failure reported, while reads keep failing the same way.
    unreadable: Option<String>,
    /// Checked at least once: later checks wait `interval` first.
    checked: bool,
    /// A changed stamp seen at the last check, read if the next check sees it again.
    settling: Option<Stamp>,
}

impl FileDiscovery {
    /// Watch `path`, checking every `interval`. The first [`Discovery::next`] reads the file
    /// as it is now (unless it is missing).
    pub fn new(path: impl Into<PathBuf>, interval: Duration) -> Self {
        FileDiscovery {
            path: path.into(),
            interval,
            seen: None,
            unreadable: None,
            checked: false,
            settling: None,
        }
    }

    /// Read and parse an endpoints file once: `Ok(None)` when it does not exist.
    pub fn read(path: &Path) -> Result<Option<Vec<DiscoveredEndpoint>>, String> {
        let Some(text) = Self::read_text(path)? else {
            return Ok(None);
        };
        parse_endpoints(&text)
            .map(Some)
            .map_err(|e| format!("{}: {e}", path.display()))
    }

    /// The file's text: `Ok(None)` when it does not exist, `Err` when it cannot be read.
    fn read_text(path: &Path) -> Result<Option<String>, String> {
        match std::fs::metadata(path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
            Ok(m) if m.len() > MAX_FILE_BYTES => {
                return Err(format!(
                    "{} is larger than {MAX_FILE_BYTES} bytes",
                    path.display()
                ))
            }
            Ok(_) => {}
        }
        match std::fs::read_to_string(path) {
            Ok(text) => Ok(Some(text)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(format!("cannot read {}: {e}", path.display())),
        }
    }

    fn stamp(&self) -> Stamp {
        FileStamp::of(&self.path).map_or(Stamp::Missing, Stamp::Present)
    }

    /// One check: the update to report, if the file changed since the last check.
    fn check(&mut self) -> Option<Update> {
        let stamp = self.stamp();
        if self.seen == Some(stamp) {
            return None;
        }
        // A change is read once the file has kept its stamp for a whole interval (the first
        // look reads at once): by then a writer that truncates and writes in place is done. A
        // file cut at an entry boundary still parses, and would drop the entries after it.
        if self.seen.is_some() && self.settling != Some(stamp) {
            self.settling = Some(stamp);
            return None;
        }
        let previous = self.seen.replace(stamp);
        match stamp {
            // Never seen: nothing to report. Seen before: say so once, keep the list.
            Stamp::Missing => previous.map(|_| {
                Update::Failed(format!(
                    "{} is missing; keeping the current endpoints",
                    self.path.display()
                ))
            }),
            Stamp::Present(_) => {
                let text = match Self::read_text(&self.path) {
                    Ok(Some(text)) => text,
                    Ok(None) => {
                        return Some(Update::Failed(format!(
                            "{} vanished while read",
                            self.path.display()
                        )))
                    }
                    Err(e) => {
                        // Not readable for now (no permission yet, out of file descriptors, too
                        // large while being written): try again at every check, reporting each
                        // new reason once.
                        self.seen = previous;
                        if self.unreadable.as_ref() == Some(&e) {
                            return None;
                        }
                        self.unreadable = Some(e.clone());
                        return Some(Update::Failed(e));
                    }
                };
                self.unreadable = None;
                let now = self.stamp();
                if now != stamp {
                    // Written to while it was read: read it once it settles.
                    self.seen = previous;
                    self.settling = Some(now);
                    return None;
                }
                Some(match parse_endpoints(&text) {
                    Ok(list) => Update::Endpoints(list),
                    Err(e) => Update::Failed(format!("{}: {e}", self.path.display())),
                })
            }
        }
    }
}

impl Discovery for FileDiscovery {
    fn describe(&self) -> String {
        format!("file {}", self.path.display())
    }

    async fn next(&mut self) -> Update {
        loop {
            if self.checked {
                tokio::time::sleep(self.interval).await;
            }
            self.checked = true;
            if let Some(update) = self.check() {
                return update;
            }
        }
    }
}

/// One `endpoints` entry.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileEntry {
    name: String,
    address: String,
    port: u16,
    #[serde(default)]
    labels: BTreeMap<String, LabelValue>,
}

/// Label values are strings; numbers and booleans are taken as written (in a JSON file a
/// real number is read as a number first: quote `"1.10"` to keep its zero).
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum LabelValue {
    Text(String),
    Integer(i64),
    Number(f64),
    Flag(bool),
}

impl LabelValue {
    fn into_string(self) -> String {
        match self {
            LabelValue::Text(s) => s,
            LabelValue::Integer(i) => i.to_string(),
            LabelValue::Number(f) => f.to_string(),
            LabelValue::Flag(b) => b.to_string(),
        }
    }
}

/// What the event pass over a file found that the loader must not see: an alias, or nesting
/// deeper than [`MAX_DEPTH`].
#[derive(Debug, PartialEq, Eq)]
enum Refused {
    /// Line of the first YAML alias (`*name`). The loader copies the anchored node at every
    /// alias, so a few nested aliases in a small file expand to gigabytes; an endpoints list
    /// has no use for them.
    Alias(usize),
    /// Line where the nesting passed [`MAX_DEPTH`]. The parser bounds only `[`/`{` nesting;
    /// indented lists nest without limit, and dropping a tree some ten thousand levels deep
    /// overflows the stack.
    Deep(usize),
}

/// One pass over `text`'s YAML events, before anything is built (event by event: the parser's
/// own `load` recurses once per level).
fn scan_events(text: &str) -> Result<Option<Refused>, String> {
    use yaml_rust2::Event;
    let mut parser = yaml_rust2::parser::Parser::new_from_str(text);
    let mut depth = 0usize;
    loop {
        let (event, mark) = parser.next_token().map_err(|e| e.to_string())?;
        match event {
            Event::StreamEnd => return Ok(None),
            Event::Alias(_) => return Ok(Some(Refused::Alias(mark.line()))),
            Event::SequenceStart(..) | Event::MappingStart(..) => {
                depth += 1;
                if depth > MAX_DEPTH {
                    return Ok(Some(Refused::Deep(mark.line())));
                }
            }
            Event::SequenceEnd | Event::MappingEnd => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
}

/// Parse an endpoints file (YAML, or JSON) into its entries, checking each one.
pub fn parse_endpoints(text: &str) -> Result<Vec<DiscoveredEndpoint>, String> {
    match scan_events(text)? {
        Some(Refused::Alias(line)) => {
            return Err(format!(
                "line {line}: YAML aliases (`*name`) are not accepted in an endpoints file; \
                 write each entry out"
            ))
        }
        Some(Refused::Deep(line)) => {
            return Err(format!(
                "line {line}: nested deeper than {MAX_DEPTH} levels"
            ))
        }
        None => {}
    }
    let docs = yaml_rust2::YamlLoader::load_from_str(text).map_err(|e| e.to_string())?;
    let doc = match docs.as_slice() {
        [] => return Err("the file is empty; write `endpoints: []` for no endpoints".into()),
        [doc] => doc,
        _ => return Err("the file holds several YAML documents; use one".into()),
    };
    let Value::Object(mut top) = yaml_to_json(doc, 0)? else {
        return Err("expected a mapping with an `endpoints` list".into());
    };
    let endpoints = top
        .remove("endpoints")
        .ok_or("missing the `endpoints` list")?;
    if let Some(key) = top.keys().next() {
        return Err(format!(
            "unknown key `{key}`; the file has one key, `endpoints`"
        ));
    }
    let Value::Array(items) = endpoints else {
        return Err("`endpoints` must be a list (`endpoints: []` for none)".into());
    };
    let mut names = HashSet::new();
    let mut out = Vec::with_capacity(items.len());
    for (i, item) in items.into_iter().enumerate() {
        let at = format!("endpoints[{i}]");
        let entry = FileEntry::deserialize(item).map_err(|e| format!("{at}: {e}"))?;
        let name = entry.name.trim().to_string();
        if name.is_empty() || name.chars().any(char::is_control) {
            return Err(format!("{at}.name: must be a non-empty name"));
        }
        if !names.insert(name.clone()) {
            return Err(format!("{at}.name: `{name}` appears twice"));
        }
        let address = entry.address.trim().to_string();
        if address.is_empty()
            || address
                .chars()
                .any(|c| c.is_whitespace() || c.is_control() || "/?#@".contains(c))
        {
            return Err(format!(
                "{at}.address: `{address}` is not a host name or IP address"
            ));
        }
        if entry.port == 0 {
            return Err(format!("{at}.port: must be 1-65535"));
        }
        let labels: BTreeMap<String, String> = entry
            .labels
            .into_iter()
            .map(|(k, v)| (k, v.into_string()))
            .collect();
        crate::config::check_labels(&labels).map_err(|reason| format!("{at}.labels: {reason}"))?;
        let endpoint = DiscoveredEndpoint {
            name,
            address,
            port: entry.port,
            labels,
        };
        // `10.0.0.5:8000` (the port written into the address) or an IPv6 zone would make a URL
        // nothing can reach.
        if engine_of(&endpoint.base_url()).is_none() {
            return Err(format!(
                "{at}.address: `{}` is not a host name or IP address (the port goes in `port`)",
                endpoint.address
            ));
        }
        endpoint.role(Role::Both)?;
        out.push(endpoint);
    }
    Ok(out)
}

/// A YAML node as JSON, for serde. Mapping keys must be scalars.
fn yaml_to_json(node: &yaml_rust2::Yaml, depth: usize) -> Result<Value, String> {
    use yaml_rust2::Yaml;
    if depth > MAX_DEPTH {
        return Err(format!("nested deeper than {MAX_DEPTH} levels"));
    }
    Ok(match node {
        Yaml::Null => Value::Null,
        Yaml::Boolean(b) => Value::Bool(*b),
        Yaml::Integer(i) => Value::from(*i),
        // As written: a label `version: 1.10` stays "1.10" (no field of the file is a real
        // number).
        Yaml::Real(text) => Value::String(text.clone()),
        Yaml::String(s) => Value::String(s.clone()),
        Yaml::Array(items) => Value::Array(
            items
                .iter()
                .map(|item| yaml_to_json(item, depth + 1))
                .collect::<Result<_, _>>()?,
        ),
        Yaml::Hash(map) => {
            let mut out = serde_json::Map::new();
            for (k, v) in map {
                let key = match k {
                    Yaml::String(s) | Yaml::Real(s) => s.clone(),
                    Yaml::Integer(i) => i.to_string(),
                    Yaml::Boolean(b) => b.to_string(),
                    _ => return Err("mapping keys must be plain scalars".into()),
                };
                out.insert(key, yaml_to_json(v, depth + 1)?);
            }
            Value::Object(out)
        }
        Yaml::Alias(_) | Yaml::BadValue => return Err("unsupported YAML node".into()),
    })
}

/// What every discovered endpoint of a pool inherits.
#[derive(Debug, Clone, Default)]
pub struct Defaults {
    /// The pool's role (an entry's [`ROLE_LABEL`] wins).
    pub role: Role,
    /// The pool's labels (an entry's own labels win).
    pub labels: BTreeMap<String, String>,
}

/// The outcome of applying a new list (see the module doc).
#[derive(Debug, Default)]
pub struct Diff {
    /// The discovered part of the pool's next snapshot, in the source's order.
    pub endpoints: Vec<Arc<Endpoint>>,
    /// New endpoints (fresh slots).
    pub added: Vec<Arc<Endpoint>>,
    /// Endpoints to retire: gone from the list, or moved to another address.
    pub removed: Vec<Arc<Endpoint>>,
    /// Same engine (address), new name, role or labels: `(old, new)`. The new endpoint takes
    /// the old one's slot and shares its live state ([`Endpoint::same_engine_as`]); the old
    /// one is retired.
    pub relabelled: Vec<(Arc<Endpoint>, Arc<Endpoint>)>,
    /// Endpoints kept as they were.
    pub kept: usize,
}

impl Diff {
    /// Whether the list changed at all.
    pub fn changed(&self) -> bool {
        !self.added.is_empty() || !self.removed.is_empty() || !self.relabelled.is_empty()
    }
}

/// Match `desired` against the pool's current discovered endpoints by name (see the module
/// doc). `fixed` are the config's endpoints (their names and slots are taken), `draining` are
/// retired endpoints whose slots stay reserved while they have requests in flight. Fails,
/// changing nothing, when a name clashes with a fixed endpoint, an engine is listed twice (in
/// the list, or once there and once in the config: two endpoints would split its load figures
/// and its prefix index) or a role label is invalid.
pub fn diff(
    pool: &str,
    fixed: &[Arc<Endpoint>],
    current: &[Arc<Endpoint>],
    desired: &[DiscoveredEndpoint],
    defaults: &Defaults,
    draining: &[Arc<Endpoint>],
) -> Result<Diff, String> {
    /// What becomes of one desired entry.
    enum Plan {
        Keep(Arc<Endpoint>),
        Relabel(Arc<Endpoint>),
        New,
    }

    let fixed_names: HashSet<&str> = fixed.iter().map(|e| e.name.as_str()).collect();
    let mut engines: HashMap<_, String> = fixed
        .iter()
        .filter_map(|e| Some((engine_of(&e.base_url)?, e.name.clone())))
        .collect();
    let mut wanted = Vec::with_capacity(desired.len());
    let mut names = HashSet::new();
    for d in desired {
        if fixed_names.contains(d.name.as_str()) {
            return Err(format!(
                "endpoint name `{}` is already used by pool `{pool}`'s configured endpoints",
                d.name
            ));
        }
        if !names.insert(d.name.as_str()) {
            return Err(format!("endpoint name `{}` appears twice", d.name));
        }
        if let Some(engine) = engine_of(&d.base_url()) {
            if let Some(other) = engines.insert(engine, d.name.clone()) {
                return Err(format!(
                    "endpoints `{other}` and `{}` are the same engine ({}:{}); list each engine once",
                    d.name, d.address, d.port
                ));
            }
        }
        let role = d.role(defaults.role)?;
        let mut labels = defaults.labels.clone();
        labels.extend(d.labels.iter().map(|(k, v)| (k.clone(), v.clone())));
        wanted.push((d, d.base_url(), role, labels));
    }

    let mut taken: BTreeSet<usize> = fixed.iter().map(|e| e.slot).collect();
    taken.extend(
        draining
            .iter()
            .filter(|e| e.in_flight_requests() > 0)
            .map(|e| e.slot),
    );
    // First pass: what stays (as it is, or relabelled in its slot), so its slot is never
    // handed out.
    let mut plans = Vec::with_capacity(wanted.len());
    for (d, url, role, labels) in &wanted {
        let plan = match current
            .iter()
            .find(|e| e.name == d.name && &e.base_url == url)
        {
            Some(e) if e.role == *role && &e.labels == labels => Plan::Keep(e.clone()),
            Some(e) => Plan::Relabel(e.clone()),
            None => Plan::New,
        };
        if let Plan::Keep(e) | Plan::Relabel(e) = &plan {
            taken.insert(e.slot);
        }
        plans.push(plan);
    }
    // Second pass: a new name at the address of an endpoint that goes (or went and still has
    // requests in flight) is that engine renamed, relabelled into its slot.
    for (i, (_, url, _, _)) in wanted.iter().enumerate() {
        if !matches!(plans[i], Plan::New) {
            continue;
        }
        let claimed = |e: &Arc<Endpoint>| {
            plans
                .iter()
                .any(|p| matches!(p, Plan::Keep(k) | Plan::Relabel(k) if k.is_same_engine(e)))
        };
        let earlier = current
            .iter()
            .chain(draining)
            .find(|e| &e.base_url == url && !claimed(e))
            .cloned();
        if let Some(e) = earlier {
            taken.insert(e.slot);
            plans[i] = Plan::Relabel(e);
        }
    }
    let mut out = Diff::default();
    for e in current {
        let stays = plans
            .iter()
            .any(|p| matches!(p, Plan::Keep(k) | Plan::Relabel(k) if Arc::ptr_eq(k, e)));
        if !stays {
            if e.in_flight_requests() > 0 {
                taken.insert(e.slot);
            }
            out.removed.push(e.clone());
        }
    }
    for ((d, url, role, labels), plan) in wanted.into_iter().zip(plans) {
        let endpoint = |slot: usize| {
            Endpoint::new(d.name.clone(), url.clone())
                .with_slot(slot)
                .with_role(role)
                .with_labels(labels.clone())
        };
        match plan {
            Plan::Keep(e) => {
                out.kept += 1;
                out.endpoints.push(e);
            }
            Plan::Relabel(old) => {
                let e = Arc::new(endpoint(old.slot).same_engine_as(&old));
                out.relabelled.push((old, e.clone()));
                out.endpoints.push(e);
            }
            Plan::New => {
                let slot = (0..).find(|s| !taken.contains(s)).unwrap_or(taken.len());
                taken.insert(slot);
                let e = Arc::new(endpoint(slot));
                out.added.push(e.clone());
                out.endpoints.push(e);
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixed(n: usize) -> Vec<Arc<Endpoint>> {
        (0..n)
            .map(|i| {
                Arc::new(
                    Endpoint::new(format!("p/{i}"), format!("http://127.0.0.1:{i}")).with_slot(i),
                )
            })
            .collect()
    }

    fn entry(name: &str, port: u16) -> DiscoveredEndpoint {
        DiscoveredEndpoint {
            name: name.into(),
            address: "10.0.0.1".into(),
            port,
            labels: BTreeMap::new(),
        }
    }

    #[test]
    fn yaml_and_json_files_parse_alike() {
        let yaml = "endpoints:\n  - name: a\n    address: 10.0.0.5\n    port: 8000\n    labels:\n      llm-d.ai/role: decode\n      gpus: 8\n  - name: b\n    address: \"::1\"\n    port: 8001\n";
        let json = r#"{"endpoints": [{"name": "a", "address": "10.0.0.5", "port": 8000, "labels": {"llm-d.ai/role": "decode", "gpus": 8}}, {"name": "b", "address": "::1", "port": 8001}]}"#;
        let a = parse_endpoints(yaml).unwrap();
        assert_eq!(a, parse_endpoints(json).unwrap());
        assert_eq!(a.len(), 2);
        assert_eq!(a[0].base_url(), "http://10.0.0.5:8000");
        assert_eq!(a[0].labels["gpus"], "8");
        let versioned =
            "endpoints:\n  - {name: a, address: x, port: 1, labels: {version: 1.10, ratio: 1e3}}\n";
        let labels = &parse_endpoints(versioned).unwrap()[0].labels;
        assert_eq!(
            (labels["version"].as_str(), labels["ratio"].as_str()),
            ("1.10", "1e3")
        );
        assert_eq!(a[0].role(Role::Both).unwrap(), Role::Decode);
        assert_eq!(a[1].base_url(), "http://[::1]:8001");
        assert_eq!(a[1].role(Role::Prefill).unwrap(), Role::Prefill);
        assert!(parse_endpoints("endpoints: []").unwrap().is_empty());
    }

    #[test]
    fn example_endpoints_file_parses() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/endpoints.yaml");
        let list = FileDiscovery::read(&path)
            .unwrap()
            .expect("the example exists");
        assert_eq!(list.len(), 2);
        assert!(list.iter().all(|e| e.role(Role::Both) == Ok(Role::Decode)));
    }

    #[test]
    fn bad_files_are_refused_with_the_reason() {
        // Nine levels of ten aliases each: a billion copies once loaded.
        let mut laughs = "l0: &l0 [x, x, x, x, x, x, x, x, x, x]\n".to_string();
        for level in 1..10 {
            let row = vec![format!("*l{}", level - 1); 10].join(", ");
            laughs.push_str(&format!("l{level}: &l{level} [{row}]\n"));
        }
        laughs.push_str("endpoints: []\n");
        let cases = [
            ("", "empty"),
            ("endpoints:\n  - name: a\n    address: x\n", "port"),
            ("endpoints:\n  - name: a\n    adress: x\n    port: 1\n", "adress"),
            (
                "endpoints:\n  - {name: a, address: x, port: 1}\n  - {name: a, address: y, port: 2}\n",
                "twice",
            ),
            ("endpoints:\n  - {name: a, address: x, port: 70000}\n", "endpoints"),
            ("endpoints:\n  - {name: a, address: x, port: 0}\n", "port"),
            ("endpoints:\n  - {name: a, address: 'http://x', port: 1}\n", "address"),
            (
                "endpoints:\n  - {name: a, address: '10.0.0.5:8000', port: 8000}\n",
                "the port goes in `port`",
            ),
            (
                "endpoints:\n  - {name: a, address: 'fe80::1%eth0', port: 1}\n",
                "the port goes in `port`",
            ),
            (
                "endpoints:\n  - {name: a, address: x, port: 1, labels: {llm-d.ai/role: mixed}}\n",
                "unknown role",
            ),
            (
                "endpoints:\n  - {name: a, address: x, port: 1, labels: {agentgate.io/bootstrap-port: 89980}}\n",
                "must be a port number",
            ),
            ("endpoints: [{name: a, address: x, port: 1}", "flow"),
            ("{\"endpoints\": [", ""),
            ("- a\n- b\n", ""),
            ("endpoints: 3\n", "list"),
            ("endpoints: []\nextra: 1\n", "extra"),
            ("a: 1\n---\nb: 2\n", "several"),
            (&"[".repeat(200), ""),
            (
                "x: &n a\nendpoints: [{name: *n, address: x, port: 1}]\n",
                "line 2: YAML aliases",
            ),
            (&laughs, "aliases"),
        ];
        for (text, needle) in cases {
            let e = parse_endpoints(text).expect_err(text);
            assert!(e.contains(needle), "{text:?}: {e}");
        }
    }

    #[test]
    fn diff_keeps_unchanged_arcs_adds_fresh_slots_and_retires_removed() {
        let fixed = fixed(2);
        let defaults = Defaults::default();
        let first = diff(
            "p",
            &fixed,
            &[],
            &[entry("a", 1), entry("b", 2)],
            &defaults,
            &[],
        )
        .unwrap();
        assert_eq!(first.added.len(), 2);
        let slots: Vec<usize> = first.endpoints.iter().map(|e| e.slot).collect();
        assert_eq!(slots, [2, 3]);

        // b unchanged, a removed, c added, b's port unchanged.
        let a = first.endpoints[0].clone();
        let b = first.endpoints[1].clone();
        let guard = a.begin(10, 10);
        let second = diff(
            "p",
            &fixed,
            &first.endpoints,
            &[entry("b", 2), entry("c", 3)],
            &defaults,
            &[],
        )
        .unwrap();
        assert_eq!(second.kept, 1);
        assert!(
            Arc::ptr_eq(&second.endpoints[0], &b),
            "unchanged keeps its Arc"
        );
        assert_eq!(second.removed.len(), 1);
        assert!(Arc::ptr_eq(&second.removed[0], &a));
        // a still has a request in flight: its slot 2 is not reused.
        assert_eq!(second.endpoints[1].slot, 4);
        assert_eq!(second.endpoints[1].name, "c");

        // Once a drained, its slot is free again; a changed address means a new endpoint.
        drop(guard);
        let third = diff(
            "p",
            &fixed,
            &second.endpoints,
            &[entry("b", 9), entry("c", 3), entry("d", 4)],
            &defaults,
            &second.removed,
        )
        .unwrap();
        assert_eq!(third.kept, 1);
        assert_eq!(third.removed.len(), 1);
        assert!(
            Arc::ptr_eq(&third.removed[0], &b),
            "b moved: the old b goes"
        );
        let slots: Vec<usize> = third.endpoints.iter().map(|e| e.slot).collect();
        assert_eq!(slots, [2, 4, 3], "freed slots are reused, lowest first");
        assert_eq!(third.endpoints[0].base_url, "http://10.0.0.1:9");
    }

    #[test]
    fn new_labels_on_the_same_engine_keep_its_slot_and_state() {
        let first = diff("p", &[], &[], &[entry("a", 1)], &Defaults::default(), &[]).unwrap();
        let a = first.endpoints[0].clone();
        a.set_healthy(false);
        a.set_kv_capacity_tokens(1_000_000);
        let running = a.begin(500, 100);
        let mut relabelled = entry("a", 1);
        relabelled.labels.insert("zone".into(), "x".into());
        let defaults = Defaults {
            role: Role::Decode,
            labels: BTreeMap::from([("pool".into(), "p".into())]),
        };
        let second = diff("p", &[], &first.endpoints, &[relabelled], &defaults, &[]).unwrap();
        assert!(second.changed());
        assert!(second.added.is_empty() && second.removed.is_empty());
        let (old, new) = &second.relabelled[0];
        assert!(Arc::ptr_eq(old, &a));
        assert_eq!(new.slot, a.slot);
        assert!(!new.is_healthy(), "the health verdict carries over");
        assert_eq!(new.kv_capacity_tokens(), 1_000_000);
        // The request running on the old object counts on the engine under its new labels,
        // and stops counting when it ends.
        assert_eq!((new.in_flight_requests(), new.in_flight_tokens()), (1, 500));
        assert_eq!(new.pending_prefill_tokens(), 100);
        drop(running);
        assert_eq!((new.in_flight_requests(), new.in_flight_tokens()), (0, 0));
        assert_eq!(new.pending_prefill_tokens(), 0);
        assert_eq!(new.role, Role::Decode);
        assert_eq!(new.labels["pool"], "p");
        assert_eq!(new.labels["zone"], "x");
        // Applying the same list again changes nothing.
        let third = diff(
            "p",
            &[],
            &second.endpoints,
            &[{
                let mut e = entry("a", 1);
                e.labels.insert("zone".into(), "x".into());
                e
            }],
            &defaults,
            &[],
        )
        .unwrap();
        assert!(!third.changed());
        assert_eq!(third.kept, 1);
    }

    #[test]
    fn one_engine_written_two_ways_is_one_endpoint() {
        let defaults = Defaults::default();
        let at = |address: &str| DiscoveredEndpoint {
            address: address.into(),
            ..entry("a", 8000)
        };
        let first = diff("p", &[], &[], &[at("fd00:0:0::5")], &defaults, &[]).unwrap();
        let second = diff("p", &[], &first.endpoints, &[at("fd00::5")], &defaults, &[]).unwrap();
        assert_eq!(second.kept, 1, "{second:?}");
        assert!(Arc::ptr_eq(&second.endpoints[0], &first.endpoints[0]));
        assert_eq!(first.endpoints[0].base_url, "http://[fd00::5]:8000");
        assert_eq!(
            at("Engine-1.Internal").base_url(),
            "http://engine-1.internal:8000"
        );
    }

    #[test]
    fn a_new_name_at_a_known_address_is_the_same_engine_renamed() {
        let defaults = Defaults::default();
        let first = diff("p", &[], &[], &[entry("a", 1)], &defaults, &[]).unwrap();
        let a = first.endpoints[0].clone();
        let running = a.begin(300, 0);
        let second = diff("p", &[], &first.endpoints, &[entry("b", 1)], &defaults, &[]).unwrap();
        assert!(second.added.is_empty() && second.removed.is_empty());
        let (old, b) = &second.relabelled[0];
        assert!(Arc::ptr_eq(old, &a));
        assert_eq!((b.name.as_str(), b.slot), ("b", a.slot));
        assert_eq!(
            b.in_flight_requests(),
            1,
            "the running request counts on the renamed engine"
        );

        // Removed while its request runs, then listed again under a third name: still the same
        // engine, in the same slot.
        let third = diff(
            "p",
            &[],
            &second.endpoints,
            &[entry("x", 2)],
            &defaults,
            &[],
        )
        .unwrap();
        assert!(Arc::ptr_eq(&third.removed[0], b));
        let draining = [b.clone()];
        let fourth = diff(
            "p",
            &[],
            &third.endpoints,
            &[entry("x", 2), entry("c", 1)],
            &defaults,
            &draining,
        )
        .unwrap();
        assert!(fourth.added.is_empty());
        let (old, c) = &fourth.relabelled[0];
        assert!(Arc::ptr_eq(old, b));
        assert_eq!((c.slot, c.in_flight_requests()), (a.slot, 1));
        drop(running);
        assert_eq!(c.in_flight_requests(), 0);

        // Two new names at one address: one engine listed twice, refused.
        let fifth = diff(
            "p",
            &[],
            &fourth.endpoints,
            &[entry("x", 2), entry("d", 1), entry("e", 1)],
            &defaults,
            &[],
        );
        assert!(fifth.unwrap_err().contains("same engine"));
    }

    #[test]
    fn deeply_nested_files_are_refused_before_they_are_built() {
        // Block nesting has no depth limit in the YAML parser; dropping a tree this deep would
        // overflow the stack.
        let text = format!("endpoints:\n{}1\n", "- ".repeat(200_000));
        let err = parse_endpoints(&text).unwrap_err();
        assert!(err.contains("nested deeper than"), "{err}");
        let flow = format!("endpoints: {}{}", "[".repeat(200), "]".repeat(200));
        assert!(parse_endpoints(&flow)
            .unwrap_err()
            .contains("nested deeper than"));
    }

    #[test]
    fn diff_refuses_clashing_names_and_changes_nothing() {
        let fixed = fixed(1);
        let e = diff(
            "p",
            &fixed,
            &[],
            &[entry("p/0", 1)],
            &Defaults::default(),
            &[],
        )
        .unwrap_err();
        assert!(e.contains("already used"), "{e}");
        // One engine under two names, in the list or in the list and the config.
        let twice = [entry("a", 7), entry("b", 7)];
        let e = diff("p", &fixed, &[], &twice, &Defaults::default(), &[]).unwrap_err();
        assert!(e.contains("same engine"), "{e}");
        let (mut lower, mut upper) = (entry("a", 7), entry("c", 7));
        lower.address = "engine-a".into();
        upper.address = "ENGINE-A".into();
        let e = diff("p", &fixed, &[], &[lower, upper], &Defaults::default(), &[]).unwrap_err();
        assert!(e.contains("same engine"), "{e}");
        let mut configured = entry("d", 0);
        let url = reqwest::Url::parse(&fixed[0].base_url).unwrap();
        configured.address = url.host_str().unwrap().to_string();
        configured.port = url.port_or_known_default().unwrap();
        let e = diff("p", &fixed, &[], &[configured], &Defaults::default(), &[]).unwrap_err();
        assert!(e.contains("same engine"), "{e}");
        let mut bad = entry("x", 1);
        bad.labels.insert(ROLE_LABEL.into(), "encode".into());
        assert!(diff("p", &fixed, &[], &[bad], &Defaults::default(), &[]).is_err());
    }

    #[test]
    fn file_discovery_reports_changes_and_keeps_quiet_otherwise() {
        let dir = std::env::temp_dir().join(format!(
            "agentgate-discovery-{}-{}",
            std::process::id(),
            fastrand::u64(..)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("endpoints.yaml");
        let mut watch = FileDiscovery::new(&path, Duration::from_millis(1));
        // Missing at first: nothing to report.
        assert_eq!(watch.check(), None);
        std::fs::write(&path, "endpoints:\n  - {name: a, address: h, port: 1}\n").unwrap();
        assert_eq!(
            watch.check(),
            None,
            "read once it has kept its stamp for an interval"
        );
        match watch.check() {
            Some(Update::Endpoints(list)) => assert_eq!(list[0].name, "a"),
            other => panic!("{other:?}"),
        }
        assert_eq!(watch.check(), None, "unchanged file");
        // Cut short while written in place: the rest arrives before the next check, and only
        // the whole file is read.
        std::fs::write(&path, "endpoints:\n  - {name: a, address: h, port: 1}\n").unwrap();
        std::thread::sleep(Duration::from_millis(20));
        std::fs::write(
            &path,
            "endpoints:\n  - {name: a, address: h, port: 1}\n  - {name: c, address: h, port: 2}\n",
        )
        .unwrap();
        assert_eq!(watch.check(), None);
        std::fs::write(&path, "endpoints:\n  - {name: a, address: h, port: 1}\n  - {name: c, address: h, port: 2}\n  - {name: d, address: h, port: 3}\n").unwrap();
        assert_eq!(watch.check(), None, "changed again before it settled");
        match watch.check() {
            Some(Update::Endpoints(list)) => assert_eq!(list.len(), 3),
            other => panic!("{other:?}"),
        }
        std::fs::write(&path, "endpoints: [").unwrap();
        assert_eq!(watch.check(), None);
        assert!(matches!(watch.check(), Some(Update::Failed(_))));
        std::fs::remove_file(&path).unwrap();
        assert_eq!(watch.check(), None);
        assert!(matches!(watch.check(), Some(Update::Failed(e)) if e.contains("missing")));
        assert_eq!(watch.check(), None, "missing is reported once");

        // Unreadable (here a folder in its place): reported once, then tried again at every
        // check until it reads.
        std::fs::create_dir(&path).unwrap();
        assert_eq!(watch.check(), None);
        assert!(matches!(watch.check(), Some(Update::Failed(e)) if e.contains("cannot read")));
        assert_eq!(watch.check(), None, "the same failure is reported once");
        assert_ne!(watch.seen, Some(watch.stamp()), "and is tried again");
        std::fs::remove_dir(&path).unwrap();
        std::fs::write(&path, "endpoints:\n  - {name: b, address: h, port: 1}\n").unwrap();
        assert_eq!(watch.check(), None);
        match watch.check() {
            Some(Update::Endpoints(list)) => assert_eq!(list[0].name, "b"),
            other => panic!("{other:?}"),
        }

        // A chmod changes neither the time it was modified nor its length: still a change (an
        // unreadable file made readable is then read).
        let mut perms = std::fs::metadata(&path).unwrap().permissions();
        std::thread::sleep(Duration::from_millis(20));
        perms.set_readonly(true);
        std::fs::set_permissions(&path, perms).unwrap();
        assert_eq!(watch.check(), None);
        assert!(matches!(watch.check(), Some(Update::Endpoints(_))));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
