// A dependency-free SVG line plot (loss curves, memory against context, recall against state).
#pragma once

#include <string>
#include <vector>

namespace k3 {

struct PlotSeries {
  std::string name;
  std::vector<double> x, y;
  std::string color;  // "" = from the palette
  bool markers = false;
};

struct PlotOptions {
  std::string title, xlabel, ylabel;
  bool log_x = false, log_y = false;
  int width = 760, height = 440;
};

// Writes the plot atomically to `path` (.svg).
void write_svg_plot(const std::string& path, const std::vector<PlotSeries>& series, const PlotOptions& opts);

}  // namespace k3
