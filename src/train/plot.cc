#include "train/plot.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"

namespace k3 {

namespace {
const char* kPalette[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd",
                          "#8c564b", "#e377c2", "#17becf", "#000000", "#bcbd22"};
constexpr size_t kColors = sizeof(kPalette) / sizeof(kPalette[0]);

std::string esc(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '<') o += "&lt;";
    else if (c == '>') o += "&gt;";
    else if (c == '&') o += "&amp;";
    else o += c;
  }
  return o;
}

// Compact tick labels: 0.25, 3.5, 512, 16K, 1.5M, 2G.
std::string num(double v) {
  char b[32];
  double a = std::fabs(v);
  const char* suffix[] = {"", "K", "M", "G", "T"};
  int k = 0;
  while (a >= 1000 && k < 4) a /= 1000, v /= 1000, ++k;
  if (k > 0) std::snprintf(b, sizeof b, a >= 100 ? "%.0f%s" : "%.3g%s", v, suffix[k]);
  else if (a != 0 && a < 1e-3) std::snprintf(b, sizeof b, "%.1e", v);
  else std::snprintf(b, sizeof b, "%.4g", v);
  return b;
}
}  // namespace

void write_svg_plot(const std::string& path, const std::vector<PlotSeries>& series, const PlotOptions& o) {
  const double L = 70, R = 170, T = 40, B = 55;
  const double W = o.width - L - R, H = o.height - T - B;
  auto tx = [&](double v) { return o.log_x ? std::log10(std::max(v, 1e-300)) : v; };
  auto ty = [&](double v) { return o.log_y ? std::log10(std::max(v, 1e-300)) : v; };
  double x0 = INFINITY, x1 = -INFINITY, y0 = INFINITY, y1 = -INFINITY;
  for (const auto& s : series)
    for (size_t i = 0; i < s.x.size() && i < s.y.size(); ++i) {
      if (!std::isfinite(s.y[i])) continue;
      x0 = std::min(x0, tx(s.x[i])), x1 = std::max(x1, tx(s.x[i]));
      y0 = std::min(y0, ty(s.y[i])), y1 = std::max(y1, ty(s.y[i]));
    }
  if (!(x0 < x1)) x0 -= 1, x1 += 1;
  if (!(y0 < y1)) y0 -= 1, y1 += 1;
  const double pad = 0.04 * (y1 - y0);
  y0 -= pad, y1 += pad;
  auto px = [&](double v) { return L + (tx(v) - x0) / (x1 - x0) * W; };
  auto py = [&](double v) { return T + (1 - (ty(v) - y0) / (y1 - y0)) * H; };
  std::ostringstream s;
  s << "<svg xmlns='http://www.w3.org/2000/svg' width='" << o.width << "' height='" << o.height
    << "' font-family='sans-serif' font-size='12'>\n<rect width='100%' height='100%' fill='white'/>\n";
  s << "<text x='" << L + W / 2 << "' y='22' text-anchor='middle' font-size='15'>" << esc(o.title) << "</text>\n";
  // Grid and ticks.
  for (int i = 0; i <= 5; ++i) {
    double fy = y0 + (y1 - y0) * i / 5, fx = x0 + (x1 - x0) * i / 5;
    double yv = o.log_y ? std::pow(10, fy) : fy, xv = o.log_x ? std::pow(10, fx) : fx;
    double yy = T + (1 - double(i) / 5) * H, xx = L + double(i) / 5 * W;
    s << "<line x1='" << L << "' y1='" << yy << "' x2='" << L + W << "' y2='" << yy << "' stroke='#e5e5e5'/>\n";
    s << "<text x='" << L - 6 << "' y='" << yy + 4 << "' text-anchor='end'>" << num(yv) << "</text>\n";
    s << "<line x1='" << xx << "' y1='" << T << "' x2='" << xx << "' y2='" << T + H << "' stroke='#e5e5e5'/>\n";
    s << "<text x='" << xx << "' y='" << T + H + 16 << "' text-anchor='middle'>" << num(xv) << "</text>\n";
  }
  s << "<rect x='" << L << "' y='" << T << "' width='" << W << "' height='" << H << "' fill='none' stroke='#333'/>\n";
  s << "<text x='" << L + W / 2 << "' y='" << o.height - 12 << "' text-anchor='middle'>" << esc(o.xlabel) << "</text>\n";
  s << "<text transform='translate(16," << T + H / 2 << ") rotate(-90)' text-anchor='middle'>" << esc(o.ylabel) << "</text>\n";
  for (size_t k = 0; k < series.size(); ++k) {
    const auto& se = series[k];
    std::string color = se.color.empty() ? kPalette[k % kColors] : se.color;
    s << "<polyline fill='none' stroke='" << color << "' stroke-width='1.8' points='";
    for (size_t i = 0; i < se.x.size() && i < se.y.size(); ++i)
      if (std::isfinite(se.y[i])) s << px(se.x[i]) << "," << py(se.y[i]) << " ";
    s << "'/>\n";
    if (se.markers)
      for (size_t i = 0; i < se.x.size() && i < se.y.size(); ++i)
        if (std::isfinite(se.y[i]))
          s << "<circle cx='" << px(se.x[i]) << "' cy='" << py(se.y[i]) << "' r='3' fill='" << color << "'/>\n";
    double ly = T + 14 + 18 * double(k);
    s << "<line x1='" << L + W + 12 << "' y1='" << ly - 4 << "' x2='" << L + W + 32 << "' y2='" << ly - 4
      << "' stroke='" << color << "' stroke-width='2.5'/>\n";
    s << "<text x='" << L + W + 38 << "' y='" << ly << "'>" << esc(se.name) << "</text>\n";
  }
  s << "</svg>\n";
  std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp);
    out << s.str();
    if (!out) throw error("plot", "cannot write ", tmp);
  }
  std::filesystem::rename(tmp, path);
}

}  // namespace k3
