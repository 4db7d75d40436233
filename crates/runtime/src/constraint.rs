//! Constraints on what a request may generate (JSON schemas, regular expressions, grammars;
//! the server compiles them with llguidance, `crates/grammar`): before each of the request's
//! tokens the worker asks which tokens are allowed and masks the others out of the logits, so
//! that no sampling mode can choose them; after the choice it tells the constraint the token.

use std::sync::{Arc, Mutex};

/// A constraint's state for one request (one choice).
pub trait TokenConstraint: Send {
    /// The tokens allowed next: bit `t % 32` of word `t / 32`. A constraint that has ended or
    /// failed allows only the end-of-sequence tokens.
    fn allowed(&mut self) -> Vec<u32>;
    /// The token chosen (one the last [`TokenConstraint::allowed`] allowed).
    fn accept(&mut self, token: u32);
}

/// A request's constraint, shared with the worker that runs it.
#[derive(Clone)]
pub struct Constraint(Arc<Mutex<Box<dyn TokenConstraint>>>);

impl Constraint {
    /// Wraps a constraint's state.
    pub fn new(c: impl TokenConstraint + 'static) -> Constraint {
        Constraint(Arc::new(Mutex::new(Box::new(c))))
    }

    /// Sets the logits of the tokens not allowed now to -inf.
    pub fn mask(&self, logits: &mut [f32]) {
        let allowed = self.0.lock().unwrap_or_else(|e| e.into_inner()).allowed();
        for (t, l) in logits.iter_mut().enumerate() {
            if allowed.get(t / 32).is_none_or(|w| w >> (t % 32) & 1 == 0) {
                *l = f32::NEG_INFINITY;
            }
        }
    }

    /// Tells the constraint the token chosen.
    pub fn accept(&self, token: u32) {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).accept(token);
    }
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Constraint")
    }
}

/// The same constraint (the same shared state).
impl PartialEq for Constraint {
    fn eq(&self, other: &Constraint) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Allows the tokens of a list in turn.
    struct Script(Vec<u32>);
    impl TokenConstraint for Script {
        fn allowed(&mut self) -> Vec<u32> {
            let mut w = vec![0u32; 2];
            if let Some(&t) = self.0.first() {
                w[t as usize / 32] |= 1 << (t % 32);
            }
            w
        }
        fn accept(&mut self, token: u32) {
            assert_eq!(self.0.remove(0), token);
        }
    }

    #[test]
    fn masks_all_but_the_allowed_tokens_and_advances() {
        let c = Constraint::new(Script(vec![33, 2]));
        let mut logits = vec![1.0f32; 40];
        c.mask(&mut logits);
        let kept: Vec<usize> = (0..40).filter(|&t| logits[t].is_finite()).collect();
        assert_eq!(kept, [33]);
        c.accept(33);
        let mut logits = vec![1.0f32; 70];
        c.mask(&mut logits);
        // Token 2 is allowed; tokens past the mask's 64 bits are not.
        assert_eq!((0..70).filter(|&t| logits[t].is_finite()).collect::<Vec<_>>(), [2]);
        assert_eq!(c.clone(), c);
    }
}
