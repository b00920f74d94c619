//! What a request asks its output to match, and its translation into an llguidance
//! grammar. The kinds and options are vLLM's `StructuredOutputsParams`.

use llguidance::api::TopLevelGrammar;
use serde_json::{json, Map, Value};

use crate::error::GrammarError;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ConstraintKind {
    /// `text` is a JSON Schema.
    Json,
    /// Any JSON object (`text` is ignored).
    JsonObject,
    /// `text` is a regular expression the whole output matches.
    Regex,
    /// `text` is a JSON list of strings; the output is exactly one of them.
    Choice,
    /// `text` is a grammar in llguidance's Lark dialect.
    Grammar,
}

impl ConstraintKind {
    pub fn parse(name: &str) -> Option<ConstraintKind> {
        Some(match name {
            "json" => ConstraintKind::Json,
            "json_object" => ConstraintKind::JsonObject,
            "regex" => ConstraintKind::Regex,
            "choice" => ConstraintKind::Choice,
            "grammar" => ConstraintKind::Grammar,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            ConstraintKind::Json => "json",
            ConstraintKind::JsonObject => "json_object",
            ConstraintKind::Regex => "regex",
            ConstraintKind::Choice => "choice",
            ConstraintKind::Grammar => "grammar",
        }
    }
}

/// Options of the JSON kinds.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct JsonOptions {
    /// Compact JSON: no whitespace between tokens.
    pub disable_any_whitespace: bool,
    /// Every object schema that does not say otherwise gets `additionalProperties: false`.
    pub disable_additional_properties: bool,
    /// The whitespace allowed between tokens, as a regex (instead of any JSON whitespace).
    pub whitespace_pattern: Option<String>,
}

/// A constraint as requested; equal specs compile to the same grammar (the cache key).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ConstraintSpec {
    pub kind: ConstraintKind,
    pub text: String,
    pub json: JsonOptions,
}

impl ConstraintSpec {
    pub fn new(kind: ConstraintKind, text: impl Into<String>) -> ConstraintSpec {
        ConstraintSpec { kind, text: text.into(), json: JsonOptions::default() }
    }

    fn invalid(&self, reason: impl Into<String>) -> GrammarError {
        GrammarError::InvalidConstraint { kind: self.kind.name(), reason: reason.into() }
    }

    /// The llguidance grammar for this spec (its compilation may still fail).
    pub fn to_grammar(&self) -> Result<TopLevelGrammar, GrammarError> {
        Ok(match self.kind {
            ConstraintKind::Json => {
                let schema: Value = serde_json::from_str(&self.text)
                    .map_err(|e| self.invalid(format!("the schema is not valid JSON: {e}")))?;
                TopLevelGrammar::from_json_schema(self.json_schema(schema)?)
            }
            ConstraintKind::JsonObject => {
                TopLevelGrammar::from_json_schema(self.json_schema(json!({"type": "object"}))?)
            }
            ConstraintKind::Regex => TopLevelGrammar::from_regex(&self.text),
            ConstraintKind::Choice => {
                let choices: Vec<String> = serde_json::from_str(&self.text)
                    .map_err(|e| self.invalid(format!("expected a JSON list of strings: {e}")))?;
                if choices.is_empty() {
                    return Err(self.invalid("no choices given"));
                }
                let alternatives: Vec<String> = choices.iter().map(|c| regex_syntax::escape(c)).collect();
                TopLevelGrammar::from_regex(&format!("(?:{})", alternatives.join("|")))
            }
            ConstraintKind::Grammar => TopLevelGrammar::from_lark(self.text.clone()),
        })
    }

    /// The schema with the JSON options applied (llguidance reads them from `x-guidance`).
    fn json_schema(&self, schema: Value) -> Result<Value, GrammarError> {
        let mut schema = match schema {
            Value::Bool(true) => json!({}),
            Value::Bool(false) => return Err(self.invalid("the schema `false` allows no value")),
            Value::Object(map) => Value::Object(map),
            _ => return Err(self.invalid("a JSON Schema must be an object (or a boolean)")),
        };
        if self.json.disable_additional_properties {
            close_objects(&mut schema);
        }
        let options = schema.as_object_mut().expect("an object, from above");
        if !options.contains_key("x-guidance") {
            let mut x = Map::new();
            x.insert("whitespace_flexible".into(), Value::Bool(!self.json.disable_any_whitespace));
            if let Some(pattern) = &self.json.whitespace_pattern {
                x.insert("whitespace_pattern".into(), Value::String(pattern.clone()));
            }
            options.insert("x-guidance".into(), Value::Object(x));
        }
        Ok(schema)
    }
}

/// Keywords whose value is one subschema, a list of them, or a map of them.
const ONE: [&str; 8] =
    ["additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames"];
const LIST: [&str; 4] = ["anyOf", "oneOf", "allOf", "prefixItems"];
const MAP: [&str; 5] = ["properties", "patternProperties", "$defs", "definitions", "dependentSchemas"];

/// Sets `additionalProperties: false` on every object schema in `schema` (walking only
/// subschema positions, so a property that happens to be named "properties" is safe)
/// that has `properties` and says nothing about additional ones.
fn close_objects(schema: &mut Value) {
    let Value::Object(map) = schema else {
        return;
    };
    if map.contains_key("properties") && !map.contains_key("additionalProperties") {
        map.insert("additionalProperties".into(), Value::Bool(false));
    }
    for key in ONE {
        if let Some(sub) = map.get_mut(key) {
            close_objects(sub);
        }
    }
    for key in LIST {
        if let Some(Value::Array(subs)) = map.get_mut(key) {
            subs.iter_mut().for_each(close_objects);
        }
    }
    for key in MAP {
        if let Some(Value::Object(subs)) = map.get_mut(key) {
            subs.values_mut().for_each(close_objects);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn closing_objects_walks_subschemas_only() {
        let mut schema = json!({
            "type": "object",
            "properties": {
                "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},
                "open": {"type": "object", "properties": {}, "additionalProperties": true},
            },
            "$defs": {"d": {"properties": {"y": {}}}},
            "items": {"anyOf": [{"properties": {"z": {}}}]},
        });
        close_objects(&mut schema);
        assert_eq!(schema["additionalProperties"], json!(false));
        assert_eq!(schema["properties"]["properties"]["additionalProperties"], json!(false));
        assert!(schema["properties"].get("additionalProperties").is_none(), "a property map is not a schema");
        assert_eq!(schema["properties"]["open"]["additionalProperties"], json!(true));
        assert_eq!(schema["$defs"]["d"]["additionalProperties"], json!(false));
        assert_eq!(schema["items"]["anyOf"][0]["additionalProperties"], json!(false));
    }

    #[test]
    fn json_options_go_into_x_guidance_unless_the_schema_sets_it() {
        let mut spec = ConstraintSpec::new(ConstraintKind::Json, "{}");
        spec.json.disable_any_whitespace = true;
        spec.json.whitespace_pattern = Some(" ?".into());
        let s = spec.json_schema(json!({})).unwrap();
        assert_eq!(s["x-guidance"], json!({"whitespace_flexible": false, "whitespace_pattern": " ?"}));
        let s = spec.json_schema(json!({"x-guidance": {"lenient": true}})).unwrap();
        assert_eq!(s["x-guidance"], json!({"lenient": true}));
        assert!(spec.json_schema(json!(false)).is_err());
        assert!(spec.json_schema(json!([1])).is_err());
    }
}
