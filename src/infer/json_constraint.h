// Constrained decoding to JSON (OpenAI's response_format json_object and json_schema): a byte-level
// recognizer of JSON documents, optionally shaped by a JSON Schema, and per-step token masks over a
// tokenizer's vocabulary built from it. Each step the tokens whose bytes cannot continue a valid
// document get -inf logits, so every completion that finishes parses and validates.
//
// Schemas: the subset that structured-output APIs use. type (one or a list), properties with
// required (a schema with properties admits no other keys), items with minItems/maxItems, enum,
// const, anyOf (alternatives must begin with different characters: '{', '[', '"', a digit, ...),
// minLength/maxLength of strings, $ref to "#/$defs/NAME" or "#/definitions/NAME" (recursion
// included; what pydantic writes for nested models); annotations (title, description, default, examples, $schema) are
// ignored. Anything else is refused with an error naming it, never ignored: an ignored keyword
// would let outputs through that do not validate.
// Whitespace between tokens is spaces, tabs and at most one line break in a run of at most 16
// characters (pretty-printing fits), so a model cannot stall in whitespace or blank lines; numbers are at most 32 characters with at most two exponent
// digits (they parse as finite doubles), integers at most 18 digits (they fit int64). A schema's
// properties are each given at most once; strings are valid UTF-8.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "io/config.h"

namespace k3 {

class Tokenizer;

class JsonSchema {
 public:
  struct Node;
  // Any JSON object (response_format {"type": "json_object"}).
  static std::shared_ptr<const JsonSchema> any_object();
  // A JSON Schema (response_format json_schema's "schema"); k3::Error names what is not supported.
  static std::shared_ptr<const JsonSchema> compile(const Json& schema);
  const Node* root() const { return root_; }
  const Node* any() const { return any_; }
  ~JsonSchema();

 private:
  JsonSchema();
  const Node* build(const Json& s, const std::string& where, int depth);
  const Node* resolve(const std::string& ref, const std::string& where, int depth);
  std::vector<std::unique_ptr<Node>> nodes_;
  const Json* document_ = nullptr;            // the schema being compiled ($ref targets)
  std::map<std::string, Node*> refs_;         // resolved $refs (recursive schemas point back)
  const Node* root_ = nullptr;
  const Node* any_ = nullptr;
};

// The recognizer: fed bytes, it says whether they continue a valid document.
class JsonMatcher {
 public:
  explicit JsonMatcher(std::shared_ptr<const JsonSchema> schema);
  // Whether `bytes` continue the document; on false the matcher is left as it was.
  bool feed(std::string_view bytes);
  // A whole document has been read (only whitespace may follow).
  bool done() const;
  // Inside a string without a length limit, between characters: any printable ASCII but '"' and
  // '\\' continues it (the fast path of the token masks).
  bool in_free_string() const;

  struct Frame;
  JsonMatcher(const JsonMatcher&);
  JsonMatcher& operator=(const JsonMatcher&);
  ~JsonMatcher();

 private:
  friend class JsonConstraint;
  bool feed_raw(std::string_view bytes);  // no restore on failure
  bool step(unsigned char c);
  bool structural_ws(unsigned char c);
  void end_ws();
  void pop();
  std::shared_ptr<const JsonSchema> schema_;
  std::vector<Frame> stack_;
  int ws_run_ = 0;
  bool ws_newline_ = false;
  bool finished_ = false;
};

// A vocabulary's token bytes, shared by the requests of a server (special tokens have none).
struct TokenBytes {
  std::vector<std::string> bytes;
  std::vector<uint8_t> plain;  // 1: printable ASCII without '"' and '\\' (free-string fast path)
  // Compact copies for the masks' scan: the first two bytes, and the length (at most 255).
  std::vector<uint8_t> first, second, size;
  static std::shared_ptr<const TokenBytes> of(const Tokenizer& tok);
  static std::shared_ptr<const TokenBytes> of(std::vector<std::string> bytes);
};

// One request's constraint: masks logits and follows the tokens taken.
class JsonConstraint {
 public:
  JsonConstraint(std::shared_ptr<const JsonSchema> schema, std::shared_ptr<const TokenBytes> vocab);
  // Sets the logits of the tokens that cannot come next to -inf; returns how many may (0: the
  // vocabulary cannot continue the document).
  int64_t mask(float* logits, int64_t V) const;
  // Takes token `id`; throws k3::Error if it does not continue the document.
  void accept(int64_t id);
  bool done() const { return m_.done(); }

 private:
  JsonMatcher m_;
  std::shared_ptr<const TokenBytes> vocab_;
};

}  // namespace k3
