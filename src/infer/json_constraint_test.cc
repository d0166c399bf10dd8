// The JSON recognizer against nlohmann::json's parser (an independent one), schemas against a
// validator written here from the schema's meaning, and the token masks against feeding every
// token by brute force; then 1,000 sampled completions per schema that must parse and validate.
#include "infer/json_constraint.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/random.h"
#include "infer/generate.h"
#include "tokenizer/bpe.h"
#include "models/registry.h"

namespace k3 {
namespace {

std::shared_ptr<const JsonSchema> schema(const char* text) { return JsonSchema::compile(Json::parse(text)); }

bool matches(const std::shared_ptr<const JsonSchema>& s, const std::string& doc) {
  JsonMatcher m(s);
  return m.feed(doc) && m.done();
}

TEST(JsonMatcher, AgreesWithAJsonParserOnObjects) {
  const auto any = JsonSchema::any_object();
  const std::vector<std::string> docs = {
      "{}", "{\"a\":1}", "{ \"a\" : 0 }", "{\"a\":[1,2.5,-3e+2,0.5E-7,true,false,null,\"x\\n\\u00e9\\\"\"],\"b\":{\"c\":{}}}",
      "{\"\xc3\xbc\":\"\xe6\x97\xa5\xe6\x9c\xac \xf0\x9f\x98\x80\"}", "{\"a\":[],\"b\":[[],[{}]]}", "{\"a\":-0}",
      // not JSON, or not an object:
      "[]", "1", "\"s\"", "{\"a\":01}", "{\"a\":1,}", "{\"a\" 1}", "{a:1}", "{\"a\":tru}", "{\"a\":\"\x01\"}",
      "{\"a\":1}}", "{\"a\":-}", "{\"a\":1.}", "{\"a\":\"\\q\"}", "{\"a\":[1,]}", "{\"a\":.5}", "{\"a\":1e}",
      "{\"a\":\"\xff\"}", "{\"a\":\"\xc3\"}", "{\"a\":nul}", "{\"a\":truex}", "{,}", "{\"a\":1 \"b\":2}"};
  for (const auto& d : docs) {
    const bool want = Json::accept(d) && Json::parse(d).is_object();
    EXPECT_EQ(matches(any, d), want) << d;
  }
  // Whitespace runs are held to 16 characters and one line break, without \r; a prefix is not a
  // document.
  EXPECT_TRUE(matches(any, "{\n  \"a\": 1\n}"));
  EXPECT_TRUE(matches(any, "{\n\t\"a\": [\n\t\t1\n\t]\n}"));
  EXPECT_FALSE(matches(any, "{\n\n\"a\": 1}"));
  EXPECT_FALSE(matches(any, "{\r\n\"a\": 1}"));
  EXPECT_FALSE(matches(any, "{" + std::string(17, ' ') + "\"a\":1}"));
  EXPECT_TRUE(matches(any, "{\"a\":1e99}"));
  EXPECT_FALSE(matches(any, "{\"a\":1e343}"));  // not a finite double
  EXPECT_FALSE(matches(schema(R"({"properties":{"a":{}}})"), "{\"a\":1,\"a\":2}"));  // a property once
  for (const char* bad : {"\xe0\x80\x80", "\xed\xa0\x80", "\xf4\x90\x80\x80", "\xc0\xaf", "\xf5\x80\x80\x80"})
    EXPECT_FALSE(matches(any, std::string("{\"a\":\"") + bad + "\"}")) << "overlong, surrogate or out of range";
  JsonMatcher m(any);
  EXPECT_TRUE(m.feed("{\"a\":"));
  EXPECT_FALSE(m.done());
  EXPECT_FALSE(m.feed("}"));  // refused, and the matcher is as it was
  EXPECT_TRUE(m.feed("2}"));
  EXPECT_TRUE(m.done());
  EXPECT_TRUE(m.feed(" "));
  EXPECT_FALSE(m.feed("{"));
}

// Random values printed by the reference parser are read whole; random mutations of them are
// read whole only if the reference parser accepts them too.
TEST(JsonMatcher, RandomDocumentsAndMutations) {
  Rng rng(7);
  std::function<Json(int)> value = [&](int depth) -> Json {
    switch (rng.below(depth > 3 ? 5 : 7)) {
      case 0: return Json(int64_t(rng.below(2000)) - 1000);
      case 1: return Json(double(rng.normal()) * 1e3);
      case 2: return Json(rng.below(2) == 1);
      case 3: return Json(nullptr);
      case 4: {
        std::string s;
        const char* pieces[] = {"a", "\"", "\\", "\n", "\x01", "\xc3\xa9", " ", "z", "\xf0\x9f\x98\x80"};
        for (uint64_t i = 0, n = rng.below(6); i < n; ++i) s += pieces[rng.below(9)];
        return Json(s);
      }
      case 5: {
        Json a = Json::array();
        for (uint64_t i = 0, n = rng.below(4); i < n; ++i) a.push_back(value(depth + 1));
        return a;
      }
      default: {
        Json o = Json::object();
        for (uint64_t i = 0, n = rng.below(4); i < n; ++i) o["k" + std::to_string(rng.below(5))] = value(depth + 1);
        return o;
      }
    }
  };
  const auto any = JsonSchema::any_object();
  int mutated_ok = 0;
  for (int i = 0; i < 500; ++i) {
    Json o = Json::object();
    o["x"] = value(0);
    const std::string d = o.dump();
    ASSERT_TRUE(matches(any, d)) << d;
    std::string m = d;
    const size_t at = size_t(rng.below(uint64_t(m.size())));
    const char subst[] = "{}[],:\"0-.e \\tfn";
    if (rng.below(2)) m[at] = subst[rng.below(sizeof(subst) - 1)];
    else m.erase(at, 1);
    const bool ref = Json::accept(m) && Json::parse(m).is_object();
    if (m.find(std::string(17, ' ')) == std::string::npos) {
      EXPECT_EQ(matches(any, m), ref) << m;
    }
    mutated_ok += ref;
  }
  EXPECT_GT(mutated_ok, 0);
}

const char* kPerson = R"({
  "type": "object",
  "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 12},
    "age": {"type": "integer"},
    "score": {"type": ["number", "null"]},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    "ok": {"type": "boolean"},
    "pet": {"anyOf": [{"type": "object", "properties": {"kind": {"const": "cat"}}, "required": ["kind"]},
                      {"type": "string", "maxLength": 4}]}
  },
  "required": ["name", "age"],
  "additionalProperties": false,
  "title": "a person"
})";

// What the schema above means, written directly on parsed values.
bool valid_person(const Json& v) {
  if (!v.is_object() || !v.contains("name") || !v.contains("age")) return false;
  for (const auto& [k, x] : v.items()) {
    if (k == "name") {
      if (!x.is_string()) return false;
      // characters, not bytes
      size_t chars = 0;
      for (unsigned char c : x.get<std::string>()) chars += (c & 0xC0) != 0x80;
      if (chars < 1 || chars > 12) return false;
    } else if (k == "age") {
      if (!x.is_number_integer()) return false;
    } else if (k == "score") {
      if (!x.is_number() && !x.is_null()) return false;
    } else if (k == "tags") {
      if (!x.is_array() || x.size() > 3) return false;
      for (const Json& t : x)
        if (t != "a" && t != "b" && t != "c") return false;
    } else if (k == "ok") {
      if (!x.is_boolean()) return false;
    } else if (k == "pet") {
      const bool cat = x.is_object() && x.size() == 1 && x.contains("kind") && x["kind"] == "cat";
      size_t chars = 0;
      if (x.is_string())
        for (unsigned char c : x.get<std::string>()) chars += (c & 0xC0) != 0x80;
      if (!cat && !(x.is_string() && chars <= 4)) return false;
    } else {
      return false;
    }
  }
  return true;
}

TEST(JsonSchemaMatch, PersonSchemaAcceptsExactlyItsInstances) {
  const auto s = schema(kPerson);
  const std::vector<std::string> docs = {
      R"({"name":"Ann","age":31})", R"({"age":-4,"name":"B","ok":true})",
      R"({"name":"Ann","age":31,"score":null,"tags":["a","c"],"pet":{"kind":"cat"}})",
      R"({"name":"Ann","age":31,"score":2.5e3,"pet":"dog"})",
      R"({"name":"Ann"})",                        // age is required
      R"({"name":"","age":1})",                   // minLength
      R"({"name":"abcdefghijklm","age":1})",      // maxLength
      R"({"name":"Ann","age":1.5})",              // integer
      R"({"name":"Ann","age":1,"x":1})",          // no other keys
      R"({"name":"Ann","age":1,"tags":["d"]})",   // enum
      R"({"name":"Ann","age":1,"tags":["a","a","a","a"]})",  // maxItems
      R"({"name":"Ann","age":1,"ok":"yes"})",     // boolean
      R"({"name":"Ann","age":1,"pet":{"kind":"dog"}})",      // const
      R"({"name":"Ann","age":1,"pet":"horse"})",  // maxLength in the other branch
      R"({"name":"\u00e9t\u00e9","age":7})",
  };
  for (const auto& d : docs) EXPECT_EQ(matches(s, d), valid_person(Json::parse(d))) << d;
  EXPECT_FALSE(matches(s, R"(["Ann", 31])"));
}

// What pydantic writes for nested and recursive models: $defs and $ref, Optional as anyOf with null.
TEST(JsonSchemaMatch, DefsAndRecursiveRefs) {
  const auto s = schema(R"({
    "$defs": {
      "Node": {"type": "object", "title": "Node",
               "properties": {"name": {"type": "string"},
                              "next": {"anyOf": [{"$ref": "#/$defs/Node"}, {"type": "null"}]},
                              "kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}}},
               "required": ["name"], "additionalProperties": false},
      "Color": {"enum": ["red", "blue"], "type": "string"}
    },
    "type": "object",
    "properties": {"root": {"$ref": "#/$defs/Node"}, "color": {"$ref": "#/$defs/Color"}},
    "required": ["root", "color"]})");
  EXPECT_TRUE(matches(s, R"({"root":{"name":"a"},"color":"red"})"));
  EXPECT_TRUE(matches(s, R"({"color":"blue","root":{"name":"a","next":{"name":"b","next":null},"kids":[{"name":"c","kids":[]}]}})"));
  EXPECT_FALSE(matches(s, R"({"root":{"name":"a"},"color":"green"})"));
  EXPECT_FALSE(matches(s, R"({"root":{"name":"a","next":{"next":null}},"color":"red"})"));  // the inner name
  EXPECT_FALSE(matches(s, R"({"root":{"name":"a","kids":[{"name":1}]},"color":"red"})"));
  EXPECT_THROW(schema(R"({"$ref":"#/$defs/Missing"})"), Error);
  EXPECT_THROW(schema(R"({"$defs":{"A":{"anyOf":[{"$ref":"#/$defs/A"},{"type":"null"}]}},"$ref":"#/$defs/A"})"), Error);
}

TEST(JsonSchemaMatch, UnsupportedSchemasAreRefusedByName) {
  auto refused = [](const char* text, const std::string& needle) {
    try {
      schema(text);
    } catch (const Error& e) {
      return std::string(e.what()).find(needle) != std::string::npos;
    }
    return false;
  };
  EXPECT_TRUE(refused(R"({"type":"string","pattern":"^a"})", "'pattern'"));
  EXPECT_TRUE(refused(R"({"$ref":"http://example.com/s.json"})", "$defs"));
  EXPECT_TRUE(refused(R"({"anyOf":[{"type":"object"},{"type":"object","properties":{"a":{}}}]})", "begin with '{'"));
  EXPECT_TRUE(refused(R"({"type":"object","properties":{"a":{}},"additionalProperties":true})", "additionalProperties"));
  EXPECT_TRUE(refused(R"({"type":"object","properties":{"a":{}},"required":["b"]})", "\"b\""));
  EXPECT_TRUE(refused(R"({"type":"strin"})", "unknown type"));
  EXPECT_TRUE(refused(R"({"type":"array","minItems":3,"maxItems":2})", "maxItems"));
  EXPECT_TRUE(refused(R"({"type":"object","properties":{"x":{"type":"number","minimum":3}}})", "/properties/x"));
}

// A small vocabulary: every byte, and multi-byte tokens that cross JSON's structure.
std::shared_ptr<const TokenBytes> test_vocab() {
  std::vector<std::string> v;
  for (int b = 0; b < 256; ++b) v.push_back(std::string(1, char(b)));
  for (const char* t : {"{\"", "\":", "\",", "\"}", "name", "age", "tags", "score", "ok", "pet", "kind", "cat",
                        "\"a\"", "\"b\",", "true", "false", "null", "12", "-3", ".5", "e+", " \"", "\": ", ", ",
                        "abc", "\xc3\xa9", "\xe6\x97\xa5", "\\n", "\\u00", "}}", "]}", "[\"", "\"]", "},{", "\xc3",
                        "ab\"", "\"x\\\"", "0}", "1,", "n\"", "e\":", "cat\"}"})
    v.push_back(t);
  v.push_back("");  // a special token: never allowed
  return TokenBytes::of(std::move(v));
}

// The masks' fast paths (first byte, plain string tokens) against feeding every token.
TEST(JsonConstraint, MasksEqualFeedingEveryToken) {
  const auto vocab = test_vocab();
  const int64_t V = int64_t(vocab->bytes.size()) + 3;  // the model's vocabulary is a little larger
  Rng rng(11);
  for (const auto& s : {JsonSchema::any_object(), schema(kPerson)}) {
    for (int run = 0; run < 20; ++run) {
      JsonConstraint c(s, vocab);
      JsonMatcher shadow(s);
      for (int step = 0; step < 60 && !c.done(); ++step) {
        std::vector<float> logits(size_t(V), 0.0f);
        const int64_t allowed = c.mask(logits.data(), V);
        int64_t count = 0;
        for (int64_t id = 0; id < V; ++id) {
          JsonMatcher t = shadow;
          const bool want = id < int64_t(vocab->bytes.size()) && !vocab->bytes[size_t(id)].empty() &&
                            t.feed(vocab->bytes[size_t(id)]);
          ASSERT_EQ(std::isfinite(logits[size_t(id)]), want) << "token " << id << " step " << step;
          count += want;
        }
        ASSERT_EQ(allowed, count);
        ASSERT_GT(allowed, 0);
        std::vector<int64_t> ok;
        for (int64_t id = 0; id < V; ++id)
          if (std::isfinite(logits[size_t(id)])) ok.push_back(id);
        const int64_t pick = ok[size_t(rng.below(uint64_t(ok.size())))];
        c.accept(pick);
        ASSERT_TRUE(shadow.feed(vocab->bytes[size_t(pick)]));
      }
    }
  }
  JsonConstraint c(JsonSchema::any_object(), vocab);
  EXPECT_THROW(c.accept(int64_t('[')), Error);
  EXPECT_THROW(c.accept(int64_t(vocab->bytes.size()) - 1), Error);  // the special token
}

// 1,000 completions per schema, sampled from random logits under the mask: every one that
// finishes parses and validates, and most finish within the token limit.
TEST(JsonConstraint, SampledCompletionsParseAndValidate) {
  const auto vocab = test_vocab();
  const int64_t V = int64_t(vocab->bytes.size());
  Rng rng(3);
  for (const bool person : {true, false}) {
    const auto s = person ? schema(kPerson) : JsonSchema::any_object();
    int finished = 0;
    for (int i = 0; i < 1000; ++i) {
      JsonConstraint c(s, vocab);
      std::string text;
      for (int step = 0; step < 400 && !c.done(); ++step) {
        std::vector<float> logits(static_cast<size_t>(V));
        for (int64_t id = 0; id < V; ++id) {
          logits[size_t(id)] = 2.0f * rng.normal();
          const std::string& b = vocab->bytes[size_t(id)];
          // A preference for closing what is open, as a trained model has: without it random
          // walks nest and write strings for ever.
          if (b.find_first_of("}]\"") != std::string::npos) logits[size_t(id)] += 6.0f;
        }
        ASSERT_GT(c.mask(logits.data(), V), 0);
        // Sample from the softmax of the masked logits.
        float mx = -INFINITY;
        for (float l : logits) mx = std::max(mx, l);
        double z = 0;
        for (float l : logits) z += std::isfinite(l) ? std::exp(double(l - mx)) : 0.0;
        double u = rng.uniform_double() * z;
        int64_t pick = 0;
        for (int64_t id = 0; id < V; ++id) {
          if (!std::isfinite(logits[size_t(id)])) continue;
          pick = id;
          u -= std::exp(double(logits[size_t(id)] - mx));
          if (u <= 0) break;
        }
        c.accept(pick);
        text += vocab->bytes[size_t(pick)];
      }
      if (!c.done()) continue;
      ++finished;
      ASSERT_TRUE(Json::accept(text)) << text;
      const Json v = Json::parse(text);
      ASSERT_TRUE(v.is_object()) << text;
      if (person) {
        ASSERT_TRUE(valid_person(v)) << text;
      }
    }
    EXPECT_GT(finished, 900) << (person ? "person schema" : "any object");
  }
}

// The token bytes of the shipped tokenizer formats (holes in the ids and special tokens have none):
// a mask over them lets exactly the tokens through whose bytes continue the document.
TEST(JsonConstraint, TokenBytesOfTheFormatsTokenizers) {
  for (const char* name : {"kimi", "qwen3", "deepseek-v3"}) {
    const Tokenizer tok = Tokenizer::from_dir(std::string(K3_SOURCE_DIR) + "/tests/data/tokenizer/formats/" + name);
    const auto vocab = TokenBytes::of(tok);
    ASSERT_EQ(int64_t(vocab->bytes.size()), int64_t(tok.vocab_size())) << name;
    for (const auto& sp : tok.specials()) EXPECT_TRUE(vocab->bytes[size_t(sp.id)].empty()) << name << " " << sp.text;
    JsonConstraint c(JsonSchema::any_object(), vocab);
    std::vector<float> logits(vocab->bytes.size(), 0.0f);
    c.mask(logits.data(), int64_t(logits.size()));
    for (size_t id = 0; id < logits.size(); ++id) {
      JsonMatcher m(JsonSchema::any_object());
      const bool want = !vocab->bytes[id].empty() && m.feed(vocab->bytes[id]);
      ASSERT_EQ(std::isfinite(logits[id]), want) << name << " token " << id;
    }
  }
}

// generate() with a schema on a random model: every sampled output stops with a document that
// parses and validates; a constrained run does not speculate.
TEST(JsonConstraint, GenerateStopsWithAValidDocument) {
  auto model = build_model(preset_config("kda-tiny"), "kda-tiny");  // no position limit
  model->init_random(2);
  std::vector<std::string> bytes;
  const char* pieces[] = {"{\"", "\":", "\",", "\"}", "a", "b", "true", "null", "12", "-3", " ", "]}", "[\""};
  for (int64_t id = 0; id < model->vocab_size(); ++id)
    bytes.push_back(id < 256 ? std::string(1, char(id)) : pieces[size_t(id) % 13]);
  GenerateOptions o;
  o.max_new_tokens = 1000;
  o.sampling.temperature = 1.0f;
  o.stop_at_eos = StopAtEos::No;
  o.json = schema(kPerson);
  o.token_bytes = TokenBytes::of(bytes);
  const std::vector<int64_t> prompt = {1, 2, 3};
  for (uint64_t seed = 0; seed < 5; ++seed) {
    o.sampling.seed = seed;
    const auto ids = generate(*model, prompt, o);
    std::string text;
    for (size_t i = prompt.size(); i < ids.size(); ++i) text += bytes[size_t(ids[i])];
    ASSERT_TRUE(Json::accept(text)) << text;
    EXPECT_TRUE(valid_person(Json::parse(text))) << text;
  }
  o.speculate.ngram = true;
  EXPECT_THROW(generate(*model, prompt, o), Error);
  o.speculate.ngram = false;
  o.token_bytes = nullptr;
  EXPECT_THROW(generate(*model, prompt, o), Error);
}

}  // namespace
}  // namespace k3
