//! The Rust `async-openai` client against an in-process gateway with one instant simulated
//! replica: create, stream, chain, retrieve and delete through the client's typed Responses API,
//! so every Response object and stream event the gateway sends must deserialize into its types.

use std::error::Error;

use async_openai::config::OpenAIConfig;
use async_openai::error::{ApiErrorResponse, OpenAIError};
use async_openai::types::responses::{
    CreateResponse, CreateResponseArgs, OutputItem, Response, ResponseStreamEvent, Status,
};
use async_openai::Client;
use futures_util::StreamExt;

use agentgate::{Config, Gateway};

type TestResult = Result<(), Box<dyn Error>>;

const CONFIG: &str = r#"
[[pools]]
name = "sim"
model = "sim-model"
flavor = "vllm"

[pools.simulate]
replicas = 1
time_scale = 0.0
"#;

async fn start() -> Result<(Gateway, Client<OpenAIConfig>), Box<dyn Error>> {
    let gateway = Gateway::start(Config::parse(CONFIG)?, "127.0.0.1:0".parse()?).await?;
    let config = OpenAIConfig::new()
        .with_api_base(format!("{}/v1", gateway.base_url()))
        .with_api_key("unused-when-open");
    Ok((gateway, Client::with_config(config)))
}

/// A `sim-model` request for `input`, chained on `previous` when given.
fn request(input: &str, previous: Option<&str>) -> Result<CreateResponse, OpenAIError> {
    let mut args = CreateResponseArgs::default();
    args.model("sim-model").input(input);
    if let Some(id) = previous {
        args.previous_response_id(id);
    }
    args.build()
}

/// The API error `result` holds; anything else fails the test, naming what was `expected`.
fn api_error<T: std::fmt::Debug>(
    result: Result<T, OpenAIError>,
    expected: &str,
) -> Result<ApiErrorResponse, Box<dyn Error>> {
    match result {
        Err(OpenAIError::ApiError(e)) => Ok(e),
        other => Err(format!("expected {expected}, got {other:?}").into()),
    }
}

/// `input` chained on `previous`: it completes and names `previous` as its predecessor.
async fn chain(
    client: &Client<OpenAIConfig>,
    input: &str,
    previous: &Response,
) -> Result<Response, Box<dyn Error>> {
    let next = client
        .responses()
        .create(request(input, Some(&previous.id))?)
        .await?;
    assert_eq!(next.status, Status::Completed);
    assert_eq!(
        next.previous_response_id.as_deref(),
        Some(previous.id.as_str())
    );
    Ok(next)
}

fn message_count(response: &Response) -> usize {
    response
        .output
        .iter()
        .filter(|item| matches!(item, OutputItem::Message(_)))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_chain_retrieve_delete() -> TestResult {
    let (gateway, client) = start().await?;

    let first = client
        .responses()
        .create(request("Name three prime numbers.", None)?)
        .await?;
    assert_eq!(first.status, Status::Completed);
    assert!(first.id.starts_with("resp_"));
    assert_eq!(message_count(&first), 1);
    let text = first.output_text().unwrap_or_default();
    assert!(!text.trim().is_empty(), "output_text must not be empty");
    let usage = first
        .usage
        .clone()
        .ok_or("a completed response carries usage")?;
    assert!(usage.input_tokens > 0 && usage.output_tokens > 0);
    assert_eq!(usage.total_tokens, usage.input_tokens + usage.output_tokens);
    assert!(usage.input_tokens_details.cached_tokens <= usage.input_tokens);

    let second = chain(&client, "And their sum?", &first).await?;
    let second_usage = second
        .usage
        .clone()
        .ok_or("usage missing on the second turn")?;
    assert!(
        second_usage.input_tokens > usage.input_tokens,
        "the chained turn sees the first turn's input and output: {} <= {}",
        second_usage.input_tokens,
        usage.input_tokens
    );

    let stored = client.responses().retrieve(&first.id).await?;
    assert_eq!(stored.id, first.id);
    assert_eq!(stored.output_text(), first.output_text());

    let deleted = client.responses().delete(&first.id).await?;
    assert!(deleted.deleted);
    assert_eq!(deleted.id, first.id);
    let e = api_error(
        client.responses().retrieve(&first.id).await,
        "a 404 API error",
    )?;
    assert_eq!(e.status_code.as_u16(), 404);
    assert!(
        e.api_error.message.contains(&first.id),
        "the 404 names the id: {e}"
    );

    gateway.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unknown_previous_response_is_an_api_error() -> TestResult {
    let (gateway, client) = start().await?;
    let result = client
        .responses()
        .create(request("hi", Some("resp_unknown"))?)
        .await;
    let e = api_error(result, "previous_response_not_found")?;
    assert_eq!(e.status_code.as_u16(), 400);
    assert_eq!(
        e.api_error.code.as_deref(),
        Some("previous_response_not_found")
    );
    assert_eq!(e.api_error.param.as_deref(), Some("previous_response_id"));
    gateway.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stream_then_chain() -> TestResult {
    let (gateway, client) = start().await?;

    let mut stream = client
        .responses()
        .create_stream(request("Stream a haiku.", None)?)
        .await?;
    let mut sequence = Vec::new();
    let mut names = Vec::new();
    let mut deltas = String::new();
    let mut completed = None;
    while let Some(event) = stream.next().await {
        let event = event?;
        let (number, name) = match &event {
            ResponseStreamEvent::ResponseCreated(e) => (e.sequence_number, "created"),
            ResponseStreamEvent::ResponseInProgress(e) => (e.sequence_number, "in_progress"),
            ResponseStreamEvent::ResponseOutputItemAdded(e) => (e.sequence_number, "item_added"),
            ResponseStreamEvent::ResponseContentPartAdded(e) => (e.sequence_number, "part_added"),
            ResponseStreamEvent::ResponseOutputTextDelta(e) => {
                deltas.push_str(&e.delta);
                (e.sequence_number, "delta")
            }
            ResponseStreamEvent::ResponseOutputTextDone(e) => {
                assert_eq!(
                    e.text, deltas,
                    "output_text.done carries the concatenated deltas"
                );
                (e.sequence_number, "text_done")
            }
            ResponseStreamEvent::ResponseContentPartDone(e) => (e.sequence_number, "part_done"),
            ResponseStreamEvent::ResponseOutputItemDone(e) => (e.sequence_number, "item_done"),
            ResponseStreamEvent::ResponseCompleted(e) => {
                completed = Some(e.response.clone());
                (e.sequence_number, "completed")
            }
            other => {
                return Err(format!("unexpected event for a plain text turn: {other:?}").into())
            }
        };
        sequence.push(number);
        names.push(name);
    }
    let expected: Vec<u64> = (0..sequence.len() as u64).collect();
    assert_eq!(
        sequence, expected,
        "sequence_number counts 0..n-1 without gaps"
    );
    names.dedup();
    assert_eq!(
        names,
        [
            "created",
            "in_progress",
            "item_added",
            "part_added",
            "delta",
            "text_done",
            "part_done",
            "item_done",
            "completed"
        ]
    );
    let completed = completed.ok_or("the stream ended without response.completed")?;
    assert_eq!(completed.status, Status::Completed);
    assert!(!deltas.trim().is_empty());
    assert_eq!(completed.output_text().as_deref(), Some(deltas.as_str()));

    // The terminal event is sent after the response is stored: chain on it at once.
    let next = chain(&client, "Another one.", &completed).await?;
    let (first_in, next_in) = (
        completed.usage.map(|u| u.input_tokens).unwrap_or_default(),
        next.usage.map(|u| u.input_tokens).unwrap_or_default(),
    );
    assert!(
        next_in > first_in,
        "chained turn input {next_in} <= {first_in}"
    );

    gateway.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conversation_items_and_responses_in_a_conversation() -> TestResult {
    use async_openai::types::responses::{
        ConversationItem, ConversationParam, CreateConversationRequestArgs, EasyInputMessage,
        InputItem, MessageRole,
    };
    let (gateway, client) = start().await?;
    let first = InputItem::EasyMessage(EasyInputMessage {
        role: async_openai::types::responses::Role::User,
        content: async_openai::types::responses::EasyInputContent::Text("My name is Ada.".into()),
        ..Default::default()
    });
    let conversation = client
        .conversations()
        .create(
            CreateConversationRequestArgs::default()
                .items(vec![first])
                .build()?,
        )
        .await?;
    assert_eq!(conversation.object, "conversation");
    let mut args = CreateResponseArgs::default();
    args.model("sim-model")
        .input("What is my name?")
        .conversation(ConversationParam::ConversationID(conversation.id.clone()));
    let response = client.responses().create(args.build()?).await?;
    assert_eq!(response.status, Status::Completed);
    // Every item deserializes into the client's typed items: the first message, the turn's
    // input and its answer.
    let items = client
        .conversations()
        .items(&conversation.id)
        .list()
        .await?;
    let roles: Vec<MessageRole> = items
        .data
        .iter()
        .filter_map(|item| match item {
            ConversationItem::Message(m) => Some(m.role.clone()),
            _ => None,
        })
        .collect();
    // Newest first: the answer, then the turn's input, then the conversation's first item.
    assert_eq!(
        roles,
        [MessageRole::Assistant, MessageRole::User, MessageRole::User],
        "{items:?}"
    );
    let deleted = client.conversations().delete(&conversation.id).await?;
    assert!(deleted.deleted);
    gateway.shutdown().await;
    Ok(())
}
