//! Graceful shutdown: after SIGTERM the server keeps its listener open while the requests in
//! flight finish, answering every new generation request (and `/health`) with 503, so that a
//! client or load balancer learns at once that this server is going away; when nothing is in
//! flight, the listener closes.

use crate::error::ApiError;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The server's shutdown state and its count of generation requests in flight.
#[derive(Debug, Default)]
pub struct Drain {
    draining: AtomicBool,
    in_flight: AtomicUsize,
}

/// A generation request in flight (until its response, streamed or not, is dropped).
#[derive(Debug)]
pub struct Ticket(Arc<Drain>);

impl Drop for Ticket {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Drain {
    /// Admits a generation request: a ticket to hold until its response is done, or 503 when
    /// the server is shutting down.
    pub fn enter(self: &Arc<Self>) -> Result<Ticket, ApiError> {
        // Count first, then look: `finish` sets the flag first, then counts, so a request
        // either sees the flag or is counted.
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        let ticket = Ticket(self.clone());
        self.check()?;
        Ok(ticket)
    }

    /// 503 when the server is shutting down.
    pub fn check(&self) -> Result<(), ApiError> {
        if self.draining.load(Ordering::SeqCst) {
            Err(ApiError::unavailable())
        } else {
            Ok(())
        }
    }

    /// Generation requests in flight.
    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }

    /// Refuses new requests from now on and returns when none is in flight.
    pub async fn finish(&self) {
        self.draining.store(true, Ordering::SeqCst);
        while self.in_flight() > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn refuses_after_finish_and_waits_for_tickets() {
        let d = Arc::new(Drain::default());
        let t = d.enter().expect("admitted before shutdown");
        let waiter = tokio::spawn({
            let d = d.clone();
            async move { d.finish().await }
        });
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert!(!waiter.is_finished(), "finish returned with a request in flight");
        let e = d.enter().expect_err("a request during shutdown");
        assert_eq!(e.status, axum::http::StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(d.in_flight(), 1, "a refused request is not counted");
        drop(t);
        tokio::time::timeout(Duration::from_secs(5), waiter).await.expect("finish returns").expect("no panic");
    }
}
