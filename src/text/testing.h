// Test helpers for the Jinja engine's goldens, tests/data/chat_templates/*.json: templates,
// contexts and the text Python's jinja2 renders for them (tools/make_chat_template_goldens.py).
// For test binaries only (K3_SOURCE_DIR is defined there).
#pragma once

#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include "text/jinja.h"

namespace k3::testing {

inline const std::string kGoldenDir = std::string(K3_SOURCE_DIR) + "/tests/data/chat_templates";

inline serve::TemplateJson read_golden(const std::string& name) {
  std::ifstream f(kGoldenDir + "/" + name, std::ios::binary);
  EXPECT_TRUE(f) << "missing " << kGoldenDir << "/" << name << " (tools/make_chat_template_goldens.py writes it)";
  return serve::TemplateJson::parse(f);
}

}  // namespace k3::testing
