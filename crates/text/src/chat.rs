//! Chat templates rendered as HF's `apply_chat_template` renders them: jinja2 with
//! `trim_blocks` and `lstrip_blocks`, Python string methods (`startswith`, `split`, `strip`,
//! ...), a `tojson` that does not HTML-escape and uses Python's separators, `raise_exception`,
//! `strftime_now`, and the special tokens (`bos_token`, `eos_token`, ...) in the context.

use crate::TextError;
use minijinja::{Environment, Error, ErrorKind, Value};
use serde_json::Value as Json;

/// A compiled chat template with the special tokens it may refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    specials: serde_json::Map<String, Json>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("specials", &self.specials).finish()
    }
}

/// Python's `json.dumps(v, ensure_ascii=False, indent=indent)`.
fn py_json(v: &Json, indent: Option<usize>, depth: usize, out: &mut String) {
    let (sep, nl) = match indent {
        Some(n) => (",", Some(n)),
        None => (", ", None),
    };
    let newline = |out: &mut String, d: usize| {
        if let Some(n) = nl {
            out.push('\n');
            out.push_str(&" ".repeat(n * d));
        }
    };
    match v {
        Json::Array(a) if !a.is_empty() => {
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                py_json(x, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push(']');
        }
        Json::Object(m) if !m.is_empty() => {
            out.push('{');
            for (i, (k, x)) in m.iter().enumerate() {
                if i > 0 {
                    out.push_str(sep);
                }
                newline(out, depth + 1);
                out.push_str(&Json::String(k.clone()).to_string());
                out.push_str(": ");
                py_json(x, indent, depth + 1, out);
            }
            newline(out, depth);
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// `v` as Python's `json.dumps(v, ensure_ascii=False)` writes it (what templates' `tojson`
/// gives): `", "` between items, `": "` after keys.
pub fn python_json(v: &Json) -> String {
    let mut out = String::new();
    py_json(v, None, 0, &mut out);
    out
}

fn tojson(v: Value, kwargs: minijinja::value::Kwargs) -> Result<String, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    let _: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&v).map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let mut out = String::new();
    py_json(&json, indent, 0, &mut out);
    Ok(out)
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

fn strftime_now(fmt: String) -> String {
    // Days since the epoch → civil date (proleptic Gregorian), enough for the date formats
    // templates use (%d %b %Y, %Y-%m-%d).
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs()) as i64;
    let z = secs.div_euclid(86_400) + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let name = MONTHS[(month - 1) as usize];
    fmt.replace("%Y", &year.to_string())
        .replace("%m", &format!("{month:02}"))
        .replace("%d", &format!("{day:02}"))
        .replace("%B", name)
        .replace("%b", &name[..3])
}

/// The text of a special token entry of tokenizer_config.json (a string or `{content: ...}`).
fn token_text(v: &Json) -> Option<Json> {
    match v {
        Json::String(_) => Some(v.clone()),
        Json::Object(o) => o.get("content").cloned(),
        _ => None,
    }
}

impl ChatTemplate {
    /// Compiles `source`; `tokenizer_config` supplies the special tokens.
    pub fn new(source: &str, tokenizer_config: &Json) -> Result<ChatTemplate, TextError> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| TextError::Template(format!("chat template does not compile: {e:#}")))?;
        let mut specials = serde_json::Map::new();
        for key in ["bos_token", "eos_token", "unk_token", "pad_token"] {
            if let Some(t) = tokenizer_config.get(key).and_then(token_text) {
                specials.insert(key.to_string(), t);
            }
        }
        if let Some(Json::Array(extra)) = tokenizer_config.get("additional_special_tokens") {
            specials
                .insert("additional_special_tokens".into(), Json::Array(extra.iter().filter_map(token_text).collect()));
        }
        Ok(ChatTemplate { env, specials })
    }

    /// Renders `messages` (a JSON array of `{role, content, ...}`), with `extra` variables
    /// (such as `tools` or `enable_thinking`) merged into the context.
    pub fn render(
        &self,
        messages: &Json,
        add_generation_prompt: bool,
        extra: Option<&Json>,
    ) -> Result<String, TextError> {
        let mut ctx = self.specials.clone();
        ctx.insert("messages".into(), messages.clone());
        ctx.insert("add_generation_prompt".into(), Json::Bool(add_generation_prompt));
        ctx.insert("tools".into(), Json::Null);
        ctx.insert("documents".into(), Json::Null);
        if let Some(Json::Object(extra)) = extra {
            ctx.extend(extra.clone());
        }
        let tmpl = self.env.get_template("chat").map_err(|e| TextError::Template(e.to_string()))?;
        tmpl.render(Value::from_serialize(&ctx))
            .map_err(|e| TextError::Template(format!("rendering the chat template failed: {e:#}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tojson_matches_python() {
        let t = ChatTemplate::new("{{ x | tojson }}|{{ x | tojson(indent=2) }}", &json!({})).unwrap();
        let out = t.render(&json!([]), false, Some(&json!({"x": {"a": [1, "<é>"], "b": {}}}))).unwrap();
        assert_eq!(out, "{\"a\": [1, \"<é>\"], \"b\": {}}|{\n  \"a\": [\n    1,\n    \"<é>\"\n  ],\n  \"b\": {}\n}");
    }

    #[test]
    fn python_methods_and_raise() {
        let t = ChatTemplate::new("{{ 'a,b'.split(',')[1].upper() }}{% if messages|length == 0 %}{{ raise_exception('no messages') }}{% endif %}", &json!({})).unwrap();
        assert!(t.render(&json!([]), false, None).unwrap_err().to_string().contains("no messages"));
        assert_eq!(t.render(&json!([1]), false, None).unwrap(), "B");
    }
}
