//! `server`: the OpenAI-compatible HTTP API (`engrun serve`). HTTP (axum on tokio) → tokenizer
//! (tokio's blocking pool) → the engine thread ([`runtime::EngineHandle`]) → the detokenizer
//! thread → back to the handler as text deltas (JSON or server-sent events). The server never
//! touches device memory: it only talks to the engine through its handle.
#![deny(missing_docs)]

mod answer;
pub mod api;
pub mod detok;
pub mod dialect;
pub mod drain;
pub mod embeddings;
pub mod error;
pub mod fields;
pub mod fim;
pub mod format;
pub mod history;
pub mod metrics;
pub mod routes;
pub mod tool_parse;
mod tool_seq;
pub mod tools;

use runtime::{Engine, EngineHandle};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use text::Tokenizer;

/// Where and how to serve.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// Address to bind.
    pub host: String,
    /// Port (0: any free port; the chosen one is printed).
    pub port: u16,
    /// Require `Authorization: Bearer <key>`.
    pub api_key: Option<String>,
    /// The model name clients use.
    pub model: String,
    /// Context length of the model.
    pub max_context: usize,
    /// How long a shutdown waits for the requests in flight before it aborts them (they end
    /// with `finish_reason: "abort"`); a second SIGTERM or Ctrl-C aborts them at once.
    pub graceful_shutdown_timeout: std::time::Duration,
    /// How `/v1/embeddings` pools an input's final hidden states.
    pub pooling: runtime::Pooling,
    /// Constrained decoding against the served tokenizer (`None`: it could not be loaded, and
    /// requests with an output format get a 400).
    pub grammars: Option<Arc<grammar::Grammars>>,
}

/// Serves `engine` until SIGTERM or Ctrl-C: then it answers new requests with 503 while the
/// requests in flight finish ([`drain::Drain`]), closes the listener, aborts what is left, and
/// returns.
pub fn serve(engine: Engine, tok: Tokenizer, opts: ServeOptions) -> Result<(), String> {
    // Grammars compile on the blocking pool, and llguidance's compiler recurses once per nested
    // rule: 64 MiB stacks (reserved, not committed) keep a deep grammar an error, not an abort
    // (`grammar::ebnf` bounds the depth of what it translates to what fits).
    let rt = tokio::runtime::Builder::new_multi_thread()
        .thread_stack_size(64 << 20)
        .enable_all()
        .thread_name("http")
        .build()
        .map_err(|e| format!("starting the async runtime: {e}"))?;
    rt.block_on(async move {
        let addr = format!("{}:{}", opts.host, opts.port);
        let listener =
            tokio::net::TcpListener::bind(&addr).await.map_err(|e| format!("cannot listen on {addr}: {e}"))?;
        let local = listener.local_addr().map_err(|e| e.to_string())?;
        let tok = Arc::new(tok);
        let drain = Arc::new(drain::Drain::default());
        let created = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let (vocab, hidden) = (engine.vocab(), engine.hidden_size());
        let fim = fim::Fim::detect(|t| tok.token_to_id(t));
        let tool_syntax = dialect::ToolSyntax::of_template(tok.chat_template_source());
        let tool_tokens: Option<Vec<u32>> =
            tool_syntax.dialect().markers().iter().map(|t| tok.token_to_id(t)).collect();
        let handle = Arc::new(EngineHandle::spawn(engine));
        let state = Arc::new(routes::AppState {
            vocab,
            hidden,
            pooling: opts.pooling,
            grammars: opts.grammars.clone(),
            engine: handle.clone(),
            detok: detok::Detokenizer::spawn(tok.clone()),
            tok,
            fim,
            tool_syntax,
            tool_tokens,
            model: opts.model.clone(),
            api_key: opts.api_key.clone(),
            max_context: opts.max_context,
            metrics: metrics::Metrics::default(),
            created,
            next_id: AtomicU64::new(0),
            drain: drain.clone(),
        });
        eprintln!("serving {} on http://{local}", opts.model);
        axum::serve(listener, routes::router(state))
            .with_graceful_shutdown(shutdown(drain, handle, opts.graceful_shutdown_timeout))
            .await
            .map_err(|e| format!("server: {e}"))?;
        eprintln!("shut down");
        Ok(())
    })
}

/// Resolves once a signal came and the requests in flight have finished.
async fn shutdown(drain: Arc<drain::Drain>, engine: Arc<EngineHandle>, timeout: std::time::Duration) {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    let mut signal = async || match term.as_mut() {
        Some(s) => {
            tokio::select! {
                _ = s.recv() => {},
                _ = tokio::signal::ctrl_c() => {},
            }
        }
        None => {
            let _ = tokio::signal::ctrl_c().await;
        }
    };
    signal().await;
    eprintln!(
        "shutting down: new requests get 503; finishing the {} requests in flight (at most {:.0} s; a second \
         SIGTERM aborts them)",
        drain.in_flight(),
        timeout.as_secs_f64()
    );
    let finished = tokio::select! {
        _ = drain.finish() => true,
        _ = tokio::time::sleep(timeout) => false,
        _ = signal() => false,
    };
    if !finished {
        eprintln!("shutting down: aborting the {} requests still in flight", drain.in_flight());
        engine.abort_all();
        drain.finish().await;
    }
    eprintln!("shutting down: no request in flight; closing the listener");
}
