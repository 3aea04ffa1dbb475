//! Tool translation: Responses `tools` / `tool_choice` -> Chat Completions `tools` / `tool_choice`,
//! and the [`ToolNameMap`] that maps engine-visible function names back to the client's
//! `(name, namespace)`.
//!
//! Function tools pass through. `namespace` groups (Codex sends MCP tools this way:
//! `{type: "namespace", name, description, tools: [{type: "function", name, ...}]}`) are flattened
//! to one function per member named `<namespace>__<name>` (or `<namespace><name>` when the
//! namespace already ends in `_`), with characters outside `[A-Za-z0-9_-]` replaced by `_`, a
//! hash in place of the end of a name longer than OpenAI's 64 characters, and a numeric suffix
//! on collision; the namespace's description opens each member's, and a custom
//! member is a custom tool (below). Output `function_call` and `custom_tool_call` items carry
//! the original `name` and `namespace` again.
//!
//! Custom (freeform) tools (`{type: "custom", name, description, format}`; Codex declares
//! `apply_patch` this way for some models) take free text, not JSON. The engine sees a function
//! of one string parameter, `input`; a `format` other than plain text is added to the
//! description (`The input must follow this lark grammar: ...`), since a chat tool call cannot
//! be held to a grammar. The call comes back as a `custom_tool_call` item carrying that string
//! (see `crate::stream`), and a `custom_tool_call` in the history goes back to the engine as the
//! same function call.
//!
//! Hosted tools that no engine can run (web_search, file_search, computer use,
//! code_interpreter, image_generation, mcp, local_shell, tool_search, ...) are dropped with an
//! info log line, or rejected with a 400 under [`HostedToolPolicy::Reject`].
//!
//! `tool_choice` maps to the Chat Completions one. A choice the declared tools cannot honour
//! is refused with 400 `param: "tool_choice"`, as OpenAI does: `required` with no function or
//! custom tool, a named tool that is not declared. `allowed_tools` keeps its mode and sends
//! the engine only the allowed tools (Chat Completions cannot declare a tool and forbid it),
//! so that turn's rendered prompt differs from its neighbours' from the tool list on.

use crate::error::ApiError;
use crate::request::HostedToolPolicy;
use crate::Flavor;
use serde_json::{json, Map, Value};
use std::collections::{HashMap, HashSet};

/// The client-facing identity of a tool: its name and, for namespace members, the namespace.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ToolName {
    /// The function name as the client declared it.
    pub name: String,
    /// The namespace group the function belongs to, if any.
    pub namespace: Option<String>,
}

impl ToolName {
    /// A tool outside any namespace.
    pub fn plain(name: impl Into<String>) -> Self {
        ToolName {
            name: name.into(),
            namespace: None,
        }
    }

    /// A tool inside a namespace group.
    pub fn namespaced(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        ToolName {
            name: name.into(),
            namespace: Some(namespace.into()),
        }
    }
}

/// Two-way map between engine-visible function names and client tool names for one request.
#[derive(Clone, Debug, Default)]
pub struct ToolNameMap {
    by_engine_name: HashMap<String, ToolName>,
    by_tool: HashMap<ToolName, String>,
    /// Engine names of custom (freeform) tools.
    custom: HashSet<String>,
    /// Per flattened name, the next suffix to try for a tool whose name it clashes with, so
    /// many clashing names cost linear time, not quadratic.
    next_suffix: HashMap<String, usize>,
}

impl ToolNameMap {
    /// An empty map (every engine name resolves to itself).
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers a tool and returns the unique engine-visible name assigned to it.
    pub fn insert(&mut self, tool: ToolName) -> String {
        if let Some(existing) = self.by_tool.get(&tool) {
            return existing.clone();
        }
        let base = flattened_name(&tool);
        let mut candidate = base.clone();
        if self.by_engine_name.contains_key(&candidate) {
            let suffix = self.next_suffix.entry(base.clone()).or_insert(2);
            loop {
                let tail = format!("_{suffix}");
                let stem = prefix_within(&base, MAX_NAME_LEN.saturating_sub(tail.len()));
                candidate = format!("{stem}{tail}");
                *suffix += 1;
                if !self.by_engine_name.contains_key(&candidate) {
                    break;
                }
            }
        }
        self.by_engine_name.insert(candidate.clone(), tool.clone());
        self.by_tool.insert(tool, candidate.clone());
        candidate
    }

    /// Registers a custom (freeform) tool: a function of one string, `input`, to the engine.
    pub fn insert_custom(&mut self, tool: ToolName) -> String {
        let engine_name = self.insert(tool);
        self.custom.insert(engine_name.clone());
        engine_name
    }

    /// Whether `engine_name` is a custom tool's: its calls become `custom_tool_call` items.
    pub fn is_custom(&self, engine_name: &str) -> bool {
        self.custom.contains(engine_name)
    }

    /// The client tool for an engine-visible name; unknown names resolve to a plain tool of that name.
    pub fn resolve(&self, engine_name: &str) -> ToolName {
        self.by_engine_name
            .get(engine_name)
            .cloned()
            .unwrap_or_else(|| ToolName::plain(engine_name))
    }

    /// The engine-visible name for a client tool; tools not declared this turn get the
    /// deterministic flattened name (used for calls in the history).
    pub fn engine_name(&self, name: &str, namespace: Option<&str>) -> String {
        let tool = ToolName {
            name: name.to_string(),
            namespace: namespace.map(str::to_string),
        };
        self.by_tool
            .get(&tool)
            .cloned()
            .unwrap_or_else(|| flattened_name(&tool))
    }

    /// The engine-visible name of a tool declared this turn; `None` when it is not declared.
    pub fn declared(&self, name: &str, namespace: Option<&str>) -> Option<&str> {
        let tool = ToolName {
            name: name.to_string(),
            namespace: namespace.map(str::to_string),
        };
        self.by_tool.get(&tool).map(String::as_str)
    }

    /// Number of registered tools.
    pub fn len(&self) -> usize {
        self.by_tool.len()
    }

    /// True when no tool is registered.
    pub fn is_empty(&self) -> bool {
        self.by_tool.is_empty()
    }
}

/// Longest function name OpenAI's Chat Completions API takes (`^[a-zA-Z0-9_-]{1,64}$`).
const MAX_NAME_LEN: usize = 64;

/// `name`'s longest prefix of at most `max` bytes that ends on a character boundary.
fn prefix_within(name: &str, max: usize) -> &str {
    let mut end = name.len().min(max);
    while !name.is_char_boundary(end) {
        end -= 1;
    }
    &name[..end]
}

/// A namespace member's engine name: `<namespace>__<name>` with characters outside
/// `[A-Za-z0-9_-]` replaced by `_`; one longer than 64 characters keeps its first 47 and ends
/// in `_` and 16 hex digits of a hash of the whole name, the same every turn (so the rendered
/// tool list, and with it the cached prefix, does not change).
fn flattened_name(tool: &ToolName) -> String {
    let joined = match &tool.namespace {
        None => return tool.name.clone(),
        Some(ns) if ns.ends_with('_') => format!("{ns}{}", tool.name),
        Some(ns) => format!("{ns}__{}", tool.name),
    };
    let flat: String = joined
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '_'
            }
        })
        .collect();
    if flat.len() <= MAX_NAME_LEN {
        return flat;
    }
    // FNV-1a over the name as written (before `_` replaced anything), so two long names that
    // differ only past the cut, or only in replaced characters, stay apart.
    let hash = joined.bytes().fold(0xcbf2_9ce4_8422_2325u64, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    });
    format!("{}_{hash:016x}", prefix_within(&flat, MAX_NAME_LEN - 17))
}

/// Most tools the `namespace` tools of one request group, together.
pub const MAX_NAMESPACE_MEMBERS: usize = 1024;
/// Most bytes of namespace description the members of one request's namespaces carry
/// together (each carries a copy of its namespace's).
pub const MAX_NAMESPACE_DESCRIPTION_COPIES: usize = 4 << 20;

/// The result of translating a request's `tools`.
#[derive(Debug, Default)]
pub(crate) struct TranslatedTools {
    pub chat_tools: Vec<Value>,
    pub names: ToolNameMap,
    pub dropped: Vec<String>,
}

/// Translates the Responses `tools` array (see the module doc).
pub(crate) fn translate_tools(
    tools: Option<&Value>,
    flavor: Flavor,
    policy: HostedToolPolicy,
) -> Result<TranslatedTools, ApiError> {
    let mut out = TranslatedTools::default();
    let tools = match tools {
        None | Some(Value::Null) => return Ok(out),
        Some(Value::Array(tools)) => tools,
        Some(_) => return Err(ApiError::invalid("tools", "`tools` must be an array")),
    };
    // Namespace members and the description copies they carry, over the whole request.
    let (mut members_total, mut copies_total) = (0usize, 0usize);
    for (index, tool) in tools.iter().enumerate() {
        let param = format!("tools[{index}]");
        let kind = tool.get("type").and_then(Value::as_str).unwrap_or("");
        match kind {
            "function" => {
                let name = required_name(tool, &param)?;
                let engine_name = out.names.insert(ToolName::plain(name));
                out.chat_tools
                    .push(chat_function_tool(tool, &engine_name, flavor));
            }
            "namespace" => {
                let namespace = required_name(tool, &param)?;
                let members = tool.get("tools").and_then(Value::as_array).ok_or_else(|| {
                    ApiError::invalid(
                        format!("{param}.tools"),
                        format!("{param}.tools must be an array of function tools"),
                    )
                })?;
                // What the namespace says of its tools reaches the model with each of them: as
                // many copies as members, so their total is bounded.
                let about = tool
                    .get("description")
                    .and_then(Value::as_str)
                    .filter(|d| !d.trim().is_empty());
                members_total = members_total.saturating_add(members.len());
                copies_total = copies_total
                    .saturating_add(about.map_or(0, str::len).saturating_mul(members.len()));
                if members_total > MAX_NAMESPACE_MEMBERS
                    || copies_total > MAX_NAMESPACE_DESCRIPTION_COPIES
                {
                    return Err(ApiError::invalid(
                        format!("{param}.tools"),
                        format!(
                            "{param} brings the request's namespace tools to {members_total}, carrying {copies_total} bytes of namespace description (each member carries its namespace's): at most {MAX_NAMESPACE_MEMBERS} tools, and {MAX_NAMESPACE_DESCRIPTION_COPIES} bytes of description over them all"
                        ),
                    ));
                }
                for (member_index, member) in members.iter().enumerate() {
                    let member_param = format!("{param}.tools[{member_index}]");
                    let member_kind = member.get("type").and_then(Value::as_str);
                    let custom = member_kind == Some("custom");
                    if !matches!(member_kind, None | Some("function") | Some("custom")) {
                        let label = format!("{namespace}.{}", member_kind.unwrap_or("unknown"));
                        handle_hosted(&label, &member_param, policy, &mut out.dropped)?;
                        continue;
                    }
                    let name = required_name(member, &member_param)?;
                    let tool_name = ToolName::namespaced(namespace, name);
                    let (engine_name, mut function) = match custom {
                        true => (
                            out.names.insert_custom(tool_name),
                            custom_as_function(member),
                        ),
                        false => (out.names.insert(tool_name), member.clone()),
                    };
                    if let (Some(about), Some(fields)) = (about, function.as_object_mut()) {
                        let description = match fields.get("description").and_then(Value::as_str) {
                            Some(own) if !own.is_empty() => format!("{about}\n\n{own}"),
                            _ => about.to_string(),
                        };
                        fields.insert("description".into(), json!(description));
                    }
                    out.chat_tools
                        .push(chat_function_tool(&function, &engine_name, flavor));
                }
            }
            "custom" => {
                let name = required_name(tool, &param)?;
                let engine_name = out.names.insert_custom(ToolName::plain(name));
                out.chat_tools.push(chat_function_tool(
                    &custom_as_function(tool),
                    &engine_name,
                    flavor,
                ));
            }
            "" => {
                return Err(ApiError::invalid(
                    format!("{param}.type"),
                    format!("{param}.type is required (\"function\", \"custom\" or \"namespace\")"),
                ))
            }
            hosted => {
                let label = match tool.get("name").and_then(Value::as_str) {
                    Some(name) => format!("{hosted}:{name}"),
                    None => hosted.to_string(),
                };
                handle_hosted(&label, &param, policy, &mut out.dropped)?;
            }
        }
    }
    Ok(out)
}

fn handle_hosted(
    label: &str,
    param: &str,
    policy: HostedToolPolicy,
    dropped: &mut Vec<String>,
) -> Result<(), ApiError> {
    match policy {
        HostedToolPolicy::Drop => {
            tracing::info!(tool = ?label, "dropping hosted tool: the engines behind this gateway cannot run it");
            dropped.push(label.to_string());
            Ok(())
        }
        HostedToolPolicy::Reject => Err(ApiError::invalid(
            param,
            format!("tool `{label}` is a hosted tool that this gateway's engines cannot run; remove it or declare it as a function tool"),
        )
        .with_code("unsupported_tool")),
    }
}

fn required_name<'a>(tool: &'a Value, param: &str) -> Result<&'a str, ApiError> {
    match tool.get("name").and_then(Value::as_str) {
        Some(name) if !name.is_empty() => Ok(name),
        _ => Err(ApiError::invalid(
            format!("{param}.name"),
            format!("{param}.name is required and must be a non-empty string"),
        )),
    }
}

/// A custom tool as the function the engine sees (see the module doc).
fn custom_as_function(tool: &Value) -> Value {
    let mut description = tool
        .get("description")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    let format = tool.get("format");
    if format.and_then(|f| f.get("type")).and_then(Value::as_str) == Some("grammar") {
        let syntax = format
            .and_then(|f| f.get("syntax"))
            .and_then(Value::as_str)
            .unwrap_or("lark");
        let definition = format
            .and_then(|f| f.get("definition"))
            .and_then(Value::as_str)
            .unwrap_or("");
        if !description.is_empty() {
            description.push_str("\n\n");
        }
        description.push_str(&format!(
            "The input must follow this {syntax} grammar:\n{definition}"
        ));
    }
    let mut function = json!({
        "name": tool.get("name").cloned().unwrap_or(Value::Null),
        "parameters": {
            "type": "object",
            "properties": {"input": {"type": "string", "description": "The tool's input, as free text."}},
            "required": ["input"],
        },
    });
    if !description.is_empty() {
        function["description"] = Value::from(description);
    }
    function
}

fn chat_function_tool(tool: &Value, engine_name: &str, flavor: Flavor) -> Value {
    let mut function = Map::new();
    function.insert("name".into(), json!(engine_name));
    if let Some(description) = tool.get("description").filter(|d| d.is_string()) {
        function.insert("description".into(), description.clone());
    }
    let parameters = match tool.get("parameters") {
        Some(p) if p.is_object() => p.clone(),
        _ => json!({"type": "object", "properties": {}}),
    };
    function.insert("parameters".into(), parameters);
    // vLLM's function definition has no `strict`; SGLang's turns on constrained decoding of
    // the call's arguments with it, as OpenAI does.
    if matches!(flavor, Flavor::Openai | Flavor::Sglang) {
        if let Some(strict) = tool.get("strict").filter(|s| s.is_boolean()) {
            function.insert("strict".into(), strict.clone());
        }
    }
    json!({"type": "function", "function": function})
}

/// The Chat Completions form of a Responses `tool_choice`.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct ChatToolChoice {
    /// The `tool_choice` to send; `None` leaves it out.
    pub choice: Option<Value>,
    /// `allowed_tools`: the engine names of the tools the model may call this turn. The other
    /// declared tools are left out of the engine request (Chat Completions has no way to
    /// declare a tool and forbid it), which changes the rendered prompt.
    pub allowed: Option<HashSet<String>>,
}

impl ChatToolChoice {
    fn send(choice: Value) -> Self {
        ChatToolChoice {
            choice: Some(choice),
            allowed: None,
        }
    }
}

/// A tool the choice names but the request does not declare: OpenAI's wording and parameter.
fn undeclared(name: &str, param: &str) -> ApiError {
    ApiError::invalid(
        param,
        format!("Tool choice '{name}' not found in 'tools' parameter."),
    )
}

/// Maps the Responses `tool_choice` to the Chat Completions one. A choice the model cannot
/// honour with the tools declared this turn (`required` with no function or custom tool, a
/// named tool that is not declared) is refused, as OpenAI does, rather than dropped.
pub(crate) fn translate_tool_choice(
    choice: Option<&Value>,
    names: &ToolNameMap,
    policy: HostedToolPolicy,
) -> Result<ChatToolChoice, ApiError> {
    let Some(choice) = choice else {
        return Ok(ChatToolChoice::default());
    };
    match choice {
        Value::Null => Ok(ChatToolChoice::default()),
        Value::String(mode) => match mode.as_str() {
            "none" => Ok(ChatToolChoice::send(json!("none"))),
            "auto" | "required" if !names.is_empty() => Ok(ChatToolChoice::send(json!(mode))),
            "auto" => Ok(ChatToolChoice::default()),
            "required" => Err(ApiError::invalid(
                "tool_choice",
                "tool_choice \"required\" needs at least one function or custom tool in 'tools' (hosted tools are not run by this gateway's engines)",
            )),
            other => Err(ApiError::invalid(
                "tool_choice",
                format!("tool_choice \"{other}\" is not supported; use auto, none, required or {{\"type\": \"function\", \"name\": ...}}"),
            )),
        },
        Value::Object(object) => {
            let kind = object.get("type").and_then(Value::as_str).unwrap_or("");
            match kind {
                "function" | "custom" => {
                    let name = object.get("name").and_then(Value::as_str).ok_or_else(|| {
                        ApiError::invalid("tool_choice.name", format!("tool_choice.name is required for type \"{kind}\""))
                    })?;
                    let namespace = object.get("namespace").and_then(Value::as_str);
                    let engine_name = names
                        .declared(name, namespace)
                        .ok_or_else(|| undeclared(name, "tool_choice"))?;
                    Ok(ChatToolChoice::send(
                        json!({"type": "function", "function": {"name": engine_name}}),
                    ))
                }
                "allowed_tools" => allowed_tools(object, names, policy),
                "" => Err(ApiError::invalid("tool_choice.type", "tool_choice.type is required")),
                hosted => match policy {
                    HostedToolPolicy::Drop => {
                        tracing::info!(tool_choice = ?hosted, "ignoring tool_choice for a hosted tool the engines cannot run");
                        Ok(ChatToolChoice::default())
                    }
                    HostedToolPolicy::Reject => Err(ApiError::invalid(
                        "tool_choice",
                        format!("tool_choice `{hosted}` names a hosted tool this gateway's engines cannot run"),
                    )
                    .with_code("unsupported_tool")),
                },
            }
        }
        _ => Err(ApiError::invalid("tool_choice", "tool_choice must be a string or an object")),
    }
}

/// `{"type": "allowed_tools", "mode": "auto"|"required", "tools": [...]}`: the declared tools
/// the model may call this turn. Function and custom entries must name a declared tool; hosted
/// entries follow the hosted-tool policy (dropped, or refused).
fn allowed_tools(
    object: &Map<String, Value>,
    names: &ToolNameMap,
    policy: HostedToolPolicy,
) -> Result<ChatToolChoice, ApiError> {
    let mode = match object.get("mode") {
        None | Some(Value::Null) => "auto",
        Some(Value::String(mode)) if mode == "auto" || mode == "required" => mode.as_str(),
        Some(_) => {
            return Err(ApiError::invalid(
                "tool_choice.mode",
                "tool_choice.mode must be \"auto\" or \"required\"",
            ))
        }
    };
    let entries = object
        .get("tools")
        .and_then(Value::as_array)
        .ok_or_else(|| {
            ApiError::invalid(
                "tool_choice.tools",
                "tool_choice.tools must be an array of the tools the model may call",
            )
        })?;
    let mut allowed = HashSet::new();
    for (index, entry) in entries.iter().enumerate() {
        let param = format!("tool_choice.tools[{index}]");
        match entry.get("type").and_then(Value::as_str) {
            Some("function") | Some("custom") => {
                let name = required_name(entry, &param)?;
                let namespace = entry.get("namespace").and_then(Value::as_str);
                let engine_name = names
                    .declared(name, namespace)
                    .ok_or_else(|| undeclared(name, &param))?;
                allowed.insert(engine_name.to_string());
            }
            Some(hosted) => handle_hosted(hosted, &param, policy, &mut Vec::new())?,
            None => {
                return Err(ApiError::invalid(
                    format!("{param}.type"),
                    format!("{param}.type is required"),
                ))
            }
        }
    }
    let choice = match (allowed.is_empty(), mode) {
        (false, mode) => Some(json!(mode)),
        (true, "required") => {
            return Err(ApiError::invalid(
                "tool_choice",
                "tool_choice allows no function or custom tool, so none can be required",
            ))
        }
        (true, _) => None,
    };
    Ok(ChatToolChoice {
        choice,
        allowed: Some(allowed),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clashing_names_take_the_next_free_suffix() {
        let mut map = ToolNameMap::new();
        let taken = map.insert(ToolName::plain("ns__x_3"));
        let names: Vec<String> = ["é", "ü", "ß", "ñ"]
            .iter()
            .map(|n| map.insert(ToolName::namespaced("ns", *n)))
            .collect();
        assert_eq!(taken, "ns__x_3");
        assert_eq!(names, ["ns___", "ns____2", "ns____3", "ns____4"]);
        let clash = map.insert(ToolName::namespaced("ns", "x?3"));
        assert_eq!(clash, "ns__x_3_2", "a plain name already holds `ns__x_3`");
        assert_eq!(map.resolve("ns____4"), ToolName::namespaced("ns", "ñ"));
    }

    #[test]
    fn a_namespace_whose_description_every_member_carries_is_bounded() {
        let namespace = |members: usize, about: usize| {
            let tools: Vec<Value> = (0..members)
                .map(|i| json!({"type": "function", "name": format!("t{i}")}))
                .collect();
            json!([{"type": "namespace", "name": "ns", "description": "d".repeat(about),
                    "tools": tools}])
        };
        let refused = |tools: Value| {
            translate_tools(Some(&tools), Flavor::Vllm, HostedToolPolicy::Drop).unwrap_err()
        };
        // Too many members, or a description whose copies would take megabytes.
        assert_eq!(
            refused(namespace(MAX_NAMESPACE_MEMBERS + 1, 10))
                .param
                .as_deref(),
            Some("tools[0].tools")
        );
        assert!(refused(namespace(5, 1 << 20))
            .message
            .contains("bytes of description"));
        let fine = translate_tools(
            Some(&namespace(100, 2000)),
            Flavor::Vllm,
            HostedToolPolicy::Drop,
        )
        .unwrap();
        assert_eq!(fine.chat_tools.len(), 100);
        // The bound holds over the request, not each namespace: many namespaces, each under
        // it, are refused together.
        let mut many = Vec::new();
        for _ in 0..3 {
            many.extend(namespace(400, 10).as_array().unwrap().iter().cloned());
        }
        assert_eq!(
            refused(Value::Array(many)).param.as_deref(),
            Some("tools[2].tools")
        );
    }

    #[test]
    fn long_namespaced_names_fit_in_64_characters() {
        let mut map = ToolNameMap::new();
        let ns = "mcp__github_enterprise_server";
        // 74 and 73 characters flattened, alike in their first 47.
        let (a, b) = (
            "list_pull_request_review_comments_for_a_repo",
            "list_pull_request_review_comments_for_an_org",
        );
        let long = map.insert(ToolName::namespaced(ns, a));
        let other = map.insert(ToolName::namespaced(ns, b));
        for name in [&long, &other] {
            assert_eq!(name.len(), 64, "{name}");
            let (head, hash) = name.split_at(47);
            assert!(format!("{ns}__{a}").starts_with(head), "{name}");
            assert!(
                hash.len() == 17
                    && hash.starts_with('_')
                    && hash[1..].chars().all(|c| c.is_ascii_hexdigit()),
                "{name}"
            );
        }
        assert_ne!(long, other, "names that differ past the cut stay apart");
        // The same every turn, and resolvable from the calls of earlier turns.
        assert_eq!(ToolNameMap::new().engine_name(a, Some(ns)), long);
        assert_eq!(map.resolve(&long), ToolName::namespaced(ns, a));
        // A clash suffix keeps the name within the limit too.
        let clash = map.insert(ToolName::plain(long.clone()));
        assert!(clash.len() <= 64 && clash != long, "{clash}");
        // Short names are as before.
        assert_eq!(map.insert(ToolName::namespaced("ns", "x")), "ns__x");
    }

    #[test]
    fn name_map_round_trips_and_avoids_collisions() {
        let mut map = ToolNameMap::new();
        let a = map.insert(ToolName::namespaced("mcp__github", "create_issue"));
        let b = map.insert(ToolName::plain("mcp__github__create_issue"));
        let c = map.insert(ToolName::namespaced("mcp__fs_", "read"));
        let d = map.insert(ToolName::namespaced("my server", "do.it"));
        assert_eq!(a, "mcp__github__create_issue");
        assert_eq!(b, "mcp__github__create_issue_2");
        assert_eq!(c, "mcp__fs_read");
        assert_eq!(d, "my_server__do_it");
        assert_eq!(
            map.resolve(&a),
            ToolName::namespaced("mcp__github", "create_issue")
        );
        assert_eq!(
            map.resolve(&b),
            ToolName::plain("mcp__github__create_issue")
        );
        assert_eq!(map.resolve(&d), ToolName::namespaced("my server", "do.it"));
        assert_eq!(map.resolve("unknown"), ToolName::plain("unknown"));
        assert_eq!(map.engine_name("create_issue", Some("mcp__github")), a);
        assert_eq!(map.engine_name("x", Some("ns")), "ns__x");
        assert_eq!(map.len(), 4);
    }

    #[test]
    fn function_and_namespace_tools_translate() {
        let tools = json!([
            {"type": "function", "name": "shell", "description": "run", "strict": false,
             "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}},
            {"type": "namespace", "name": "mcp__docs", "description": "Docs server",
             "tools": [{"type": "function", "name": "search", "description": "find",
                        "strict": false, "parameters": {"type": "object"}},
                       {"type": "custom", "name": "note"}]},
        ]);
        let out = translate_tools(Some(&tools), Flavor::Vllm, HostedToolPolicy::Drop).unwrap();
        assert_eq!(out.chat_tools.len(), 3);
        assert_eq!(
            out.chat_tools[..2],
            vec![
                json!({"type": "function", "function": {"name": "shell", "description": "run",
                       "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}}}),
                // The namespace's description goes with each of its tools.
                json!({"type": "function", "function": {"name": "mcp__docs__search",
                       "description": "Docs server\n\nfind", "parameters": {"type": "object"}}}),
            ]
        );
        assert_eq!(
            out.names.resolve("mcp__docs__search"),
            ToolName::namespaced("mcp__docs", "search")
        );
        // A custom tool in a namespace is a custom tool, not a hosted one to drop.
        let note = &out.chat_tools[2]["function"];
        assert_eq!(note["name"], "mcp__docs__note");
        assert_eq!(note["description"], "Docs server");
        assert!(out.names.is_custom("mcp__docs__note"));
        assert!(out.dropped.is_empty());
        for flavor in [Flavor::Openai, Flavor::Sglang] {
            let out = translate_tools(Some(&tools), flavor, HostedToolPolicy::Drop).unwrap();
            assert_eq!(out.chat_tools[0]["function"]["strict"], json!(false));
        }
    }

    #[test]
    fn custom_tools_become_functions_of_one_string() {
        let tools = json!([{
            "type": "custom", "name": "apply_patch", "description": "Edit files.",
            "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"},
        }, {"type": "custom", "name": "note"}]);
        let out = translate_tools(Some(&tools), Flavor::Vllm, HostedToolPolicy::Reject).unwrap();
        assert!(out.dropped.is_empty());
        let patch = &out.chat_tools[0]["function"];
        assert_eq!(patch["name"], "apply_patch");
        assert_eq!(
            patch["description"],
            "Edit files.\n\nThe input must follow this lark grammar:\nstart: /.+/"
        );
        assert_eq!(patch["parameters"]["required"], json!(["input"]));
        assert_eq!(patch["parameters"]["properties"]["input"]["type"], "string");
        assert!(out.chat_tools[1]["function"].get("description").is_none());
        assert!(out.names.is_custom("apply_patch") && out.names.is_custom("note"));
        let choice = json!({"type": "custom", "name": "apply_patch"});
        let chat = translate_tool_choice(Some(&choice), &out.names, HostedToolPolicy::Reject);
        assert_eq!(
            chat.unwrap().choice,
            Some(json!({"type": "function", "function": {"name": "apply_patch"}}))
        );
    }

    #[test]
    fn hosted_tools_drop_or_reject() {
        let tools = json!([
            {"type": "web_search"},
            {"type": "function", "name": "f"},
            {"type": "local_shell"},
        ]);
        let out = translate_tools(Some(&tools), Flavor::Sglang, HostedToolPolicy::Drop).unwrap();
        assert_eq!(out.chat_tools.len(), 1);
        assert_eq!(out.dropped, vec!["web_search", "local_shell"]);
        let err =
            translate_tools(Some(&tools), Flavor::Sglang, HostedToolPolicy::Reject).unwrap_err();
        assert_eq!(err.status, 400);
        assert_eq!(err.param.as_deref(), Some("tools[0]"));
        assert!(err.message.contains("web_search"));
        let tools = json!([
            {"type": "function", "name": "f"},
            {"type": "namespace", "name": "ns", "tools": [
                {"type": "function", "name": "g"}, {"type": "web_search"}]},
        ]);
        let err =
            translate_tools(Some(&tools), Flavor::Vllm, HostedToolPolicy::Reject).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("tools[1].tools[1]"));
    }

    #[test]
    fn tool_errors_name_the_parameter() {
        let err = translate_tools(
            Some(&json!([{"type": "function"}])),
            Flavor::Vllm,
            HostedToolPolicy::Drop,
        )
        .unwrap_err();
        assert_eq!(err.param.as_deref(), Some("tools[0].name"));
        let err = translate_tools(
            Some(&json!([{"name": "x"}])),
            Flavor::Vllm,
            HostedToolPolicy::Drop,
        )
        .unwrap_err();
        assert_eq!(err.param.as_deref(), Some("tools[0].type"));
    }

    #[test]
    fn tool_choice_maps_every_form() {
        let mut names = ToolNameMap::new();
        names.insert(ToolName::namespaced("ns", "f"));
        let drop = HostedToolPolicy::Drop;
        let choice = |c: Value, names: &ToolNameMap, policy| {
            translate_tool_choice(Some(&c), names, policy).map(|t| t.choice)
        };
        assert_eq!(
            choice(json!("auto"), &names, drop).unwrap(),
            Some(json!("auto"))
        );
        assert_eq!(
            choice(json!("none"), &names, drop).unwrap(),
            Some(json!("none"))
        );
        assert_eq!(
            choice(json!("required"), &names, drop).unwrap(),
            Some(json!("required"))
        );
        assert_eq!(
            choice(
                json!({"type": "function", "name": "f", "namespace": "ns"}),
                &names,
                drop
            )
            .unwrap(),
            Some(json!({"type": "function", "function": {"name": "ns__f"}}))
        );
        assert_eq!(
            choice(json!({"type": "web_search_preview"}), &names, drop).unwrap(),
            None
        );
        assert!(choice(
            json!({"type": "web_search_preview"}),
            &names,
            HostedToolPolicy::Reject
        )
        .is_err());
        assert_eq!(
            choice(json!("auto"), &ToolNameMap::new(), drop).unwrap(),
            None
        );
        assert!(choice(json!("sometimes"), &names, drop).is_err());
    }

    #[test]
    fn a_choice_the_declared_tools_cannot_honour_is_refused() {
        let mut names = ToolNameMap::new();
        names.insert(ToolName::plain("shell"));
        let drop = HostedToolPolicy::Drop;
        // `required` with no tool the engines can call (none declared, or only hosted ones).
        let err =
            translate_tool_choice(Some(&json!("required")), &ToolNameMap::new(), drop).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("tool_choice"));
        // A named tool that is not declared: OpenAI's message, naming `tool_choice`.
        for kind in ["function", "custom"] {
            let err =
                translate_tool_choice(Some(&json!({"type": kind, "name": "deploy"})), &names, drop)
                    .unwrap_err();
            assert_eq!(err.param.as_deref(), Some("tool_choice"));
            assert_eq!(
                err.message,
                "Tool choice 'deploy' not found in 'tools' parameter."
            );
        }
    }

    #[test]
    fn allowed_tools_limit_the_tools_and_keep_the_mode() {
        let mut names = ToolNameMap::new();
        names.insert(ToolName::plain("read"));
        names.insert(ToolName::namespaced("fs", "write"));
        names.insert_custom(ToolName::plain("apply_patch"));
        let drop = HostedToolPolicy::Drop;
        let allowed = |c: Value| translate_tool_choice(Some(&c), &names, drop);
        let out = allowed(
            json!({"type": "allowed_tools", "mode": "required", "tools": [
                {"type": "function", "name": "write", "namespace": "fs"},
                {"type": "custom", "name": "apply_patch"},
                {"type": "web_search"},
            ]}),
        )
        .unwrap();
        assert_eq!(out.choice, Some(json!("required")));
        let set = out.allowed.unwrap();
        assert_eq!(set.len(), 2);
        assert!(set.contains("fs__write") && set.contains("apply_patch"));
        // `auto` is the default mode; an empty list lets the model call nothing.
        let out = allowed(json!({"type": "allowed_tools", "tools": []})).unwrap();
        assert_eq!(out.choice, None);
        assert_eq!(out.allowed, Some(HashSet::new()));
        // Refused: nothing to require, an undeclared tool, a mode OpenAI does not have.
        let err =
            allowed(json!({"type": "allowed_tools", "mode": "required", "tools": []})).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("tool_choice"));
        let err = allowed(json!({"type": "allowed_tools", "tools": [
            {"type": "function", "name": "read"}, {"type": "function", "name": "rm"},
        ]}))
        .unwrap_err();
        assert_eq!(err.param.as_deref(), Some("tool_choice.tools[1]"));
        let err =
            allowed(json!({"type": "allowed_tools", "mode": "always", "tools": []})).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("tool_choice.mode"));
        let err = allowed(json!({"type": "allowed_tools"})).unwrap_err();
        assert_eq!(err.param.as_deref(), Some("tool_choice.tools"));
    }
}
